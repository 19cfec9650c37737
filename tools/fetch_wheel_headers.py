"""Fetches the C++ headers that a PyPI wheel ships (build-time, header-only dependencies).

Usage: python3 tools/fetch_wheel_headers.py PACKAGE VERSION PREFIX DEST
  Extracts the wheel's files under PREFIX (a folder inside the wheel, e.g. "include/")
  into DEST/include. Called by CMake at configure time when the CUDA backend is built:
  nvidia-cudnn-frontend (PREFIX include/) and nvidia-cutlass
  (PREFIX cutlass_library/source/include/).
"""
import glob, os, shutil, subprocess, sys, tempfile, zipfile

package, version, prefix, dest = sys.argv[1:5]
with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "-d", tmp, f"{package}=={version}"],
                   check=True)
    wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
    staging = dest + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = os.path.join(staging, "include", name[len(prefix):])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(name) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)
print(f"{package} {version} headers in {dest}/include")
