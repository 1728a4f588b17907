# tools/device/cublas_env.sh — sourced by the device scripts: puts cuBLAS 13 (which kvbridge and the
# test binaries link; a packed build leaves it out) on LD_LIBRARY_PATH from the CUDA toolkit, or else
# from PyTorch's nvidia-* wheels. Prints nothing.
for kvb_cublas_dir in /usr/local/cuda/lib64 $(python3 -c 'import importlib,os
for m in ("nvidia.cu13","nvidia.cublas","nvidia"):
    try:
        for p in importlib.import_module(m).__path__:
            for r,_,f in os.walk(p):
                if "libcublas.so.13" in f: print(r)
    except Exception: pass' 2>/dev/null); do
  if [ -e "$kvb_cublas_dir/libcublas.so.13" ]; then
    export LD_LIBRARY_PATH="$kvb_cublas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  fi
done
