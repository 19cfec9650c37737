"""Fetches the headers of PyPI's nvidia-cudnn-frontend (cuDNN's header-only C++ frontend).

Usage: python3 tools/fetch_cudnn_frontend.py VERSION DEST  ->  DEST/include/cudnn_frontend.h
Called by CMake at configure time when the CUDA backend is built.
"""
import glob, os, subprocess, sys, tempfile, zipfile

version, dest = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "-d", tmp, f"nvidia-cudnn-frontend=={version}"],
                   check=True)
    wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
    staging = dest + ".tmp"
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("include/"):
                z.extract(name, staging)
    os.replace(staging, dest)
print(f"cudnn frontend {version} headers in {dest}/include")
