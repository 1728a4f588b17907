# tools/device/cublas_env.sh — sourced by the device scripts: puts cuBLAS 13 on LD_LIBRARY_PATH from
# the CUDA toolkit or PyTorch's nvidia-* wheels, whichever the host has first.
for kvb_d in /usr/local/cuda/lib64 $(python3 -c 'import importlib,os
for m in ("nvidia.cu13","nvidia.cublas","nvidia"):
    try:
        for p in importlib.import_module(m).__path__:
            for r,_,f in os.walk(p):
                if "libcublas.so.13" in f: print(r)
    except Exception: pass' 2>/dev/null); do
  if [ -e "$kvb_d/libcublas.so.13" ]; then
    export LD_LIBRARY_PATH="$kvb_d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  fi
done
