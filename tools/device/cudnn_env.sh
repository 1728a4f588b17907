# tools/device/cudnn_env.sh — sourced by the device scripts: puts cuDNN 9 (with NVRTC, which cuDNN's
# runtime-compiled attention engines load, and the CUDA runtime) on LD_LIBRARY_PATH from wherever
# the host has them — the CUDA toolkit, or PyTorch's nvidia-* wheels — so kvbridge's
# dlopen("libcudnn.so.9") finds it.
# Prints one line saying which cuDNN it found (or that none was found: the engine then uses its own
# attention kernel, and says so).
kvb_cudnn_dirs=$(python3 - <<'PYEOF' 2>/dev/null
import importlib, os
seen = []
for m in ("nvidia.cudnn", "nvidia.cuda_nvrtc", "nvidia.cu13", "nvidia"):
    try:
        for p in importlib.import_module(m).__path__:
            for root, dirs, files in os.walk(p):
                if any(f.startswith(("libcudnn.so.9", "libnvrtc.so", "libnvrtc-builtins.so", "libcudart.so")) for f in files):
                    if root not in seen:
                        seen.append(root)
    except Exception:
        pass
print(":".join(seen))
PYEOF
)
for d in /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
  if [ -e "$d/libcudnn.so.9" ]; then kvb_cudnn_dirs="${kvb_cudnn_dirs:+$kvb_cudnn_dirs:}$d"; fi
done
if [ -n "$kvb_cudnn_dirs" ]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$kvb_cudnn_dirs"
  echo "cuDNN: $(ls $(echo "$kvb_cudnn_dirs" | tr ':' ' ') 2>/dev/null | grep -m1 -E '^libcudnn\.so\.9\.' || echo 'libcudnn.so.9') from $kvb_cudnn_dirs"
else
  echo "cuDNN: not found on this host (the engine will use its own attention kernel)"
fi
