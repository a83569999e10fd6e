"""weft's PEP 517 build backend: `pip install .` builds the Python extension with CMake and packs a wheel of the
`weft` package alone (python/weft/*.py and the extension module: no headers, libraries or
programs). Standard library only, so that it needs nothing from a package index and works with Debian's
packages alone (cmake, a C++20 compiler, CUDA, Python headers, pybind11-dev).

Where the build happens: `--config-settings=build-dir=DIR` (pip) or WEFT_WHEEL_BUILD_DIR, else build/wheel in the
source tree. A build directory configured before (by scripts/test.sh, say) is reused: only the extension's target
is brought up to date, so a wheel after the tests costs seconds. Other CMake options go in as
`--config-settings=cmake-args="-DWEFT_SM100=ON ..."` or WEFT_WHEEL_CMAKE_ARGS.
"""
import base64
import hashlib
import io
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(ROOT, "python", "weft")


def _package_files():
    """The pure-Python modules of the package: every python/weft/*.py (as CMake copies them into the build tree)."""
    return sorted(f for f in os.listdir(PACKAGE_DIR) if f.endswith(".py"))


def _project():
    """(name, version, summary, requires-python, license) from pyproject.toml's [project] table (stdlib only:
    no tomllib before Python 3.11, so the few keys used are read by pattern)."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    table = text.split("[project]", 1)[1].split("\n[", 1)[0]

    def key(name, default=""):
        m = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(name), table, re.M)
        return m.group(1) if m else default

    lic = re.search(r'^license\s*=\s*\{\s*text\s*=\s*"([^"]*)"', table, re.M)
    return key("name"), key("version"), key("description"), key("requires-python"), lic.group(1) if lic else ""


def _dist_info_name():
    name, version = _project()[:2]
    return "%s-%s.dist-info" % (name, version)


def _metadata():
    name, version, summary, requires_python, lic = _project()
    lines = ["Metadata-Version: 2.1", "Name: " + name, "Version: " + version, "Summary: " + summary]
    if requires_python:
        lines.append("Requires-Python: " + requires_python)
    if lic:
        lines.append("License: " + lic)
    lines.append("Description-Content-Type: text/markdown")
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return "\n".join(lines) + "\n\n" + readme


def _tag():
    """cpXY-cpXY-<platform>: the extension is built for this interpreter and machine."""
    impl = "cp%d%d" % sys.version_info[:2]
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return "%s-%s-%s" % (impl, impl, platform)


def _wheel_file():
    return "Wheel-Version: 1.0\nGenerator: weft_build\nRoot-Is-Purelib: false\nTag: %s\n" % _tag()


def _setting(config_settings, key, env):
    value = (config_settings or {}).get(key)
    if isinstance(value, list):
        value = " ".join(value)
    return value or os.environ.get(env, "")


def _build_extension(config_settings):
    """Configures (once) and builds the `_weft` target; returns the path of the extension module."""
    build = _setting(config_settings, "build-dir", "WEFT_WHEEL_BUILD_DIR") or os.path.join(ROOT, "build", "wheel")
    build = os.path.abspath(build)
    extra = shlex.split(_setting(config_settings, "cmake-args", "WEFT_WHEEL_CMAKE_ARGS"))
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")) or extra:
        cmd = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DWEFT_BUILD_TESTS=OFF",
               "-DWEFT_BUILD_BENCH=OFF", "-DPython3_EXECUTABLE=" + sys.executable] + extra
        print("weft_build: " + " ".join(cmd), file=sys.stderr)
        subprocess.check_call(cmd)
    jobs = str(os.cpu_count() or 2)
    print("weft_build: building the extension in %s (a first build compiles every kernel: minutes)" % build,
          file=sys.stderr)
    subprocess.check_call(["cmake", "--build", build, "--target", "_weft", "-j", jobs])
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    module = os.path.join(build, "python", "weft", "_weft" + suffix)
    if not os.path.exists(module):
        raise RuntimeError("weft_build: %s was not built: CMake found no Python 3 development files or pybind11 "
                           "for %s (apt-get install python3-dev pybind11-dev, or pip install pybind11 and "
                           "--no-build-isolation)" % (module, sys.executable))
    return module


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


# ---- PEP 517 hooks ----------------------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    dist_info = _dist_info_name()
    path = os.path.join(metadata_directory, dist_info)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    with open(os.path.join(path, "WHEEL"), "w", encoding="utf-8") as f:
        f.write(_wheel_file())
    return dist_info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    module = _build_extension(config_settings)
    name, version = _project()[:2]
    wheel_name = "%s-%s-%s.whl" % (name, version, _tag())
    dist_info = _dist_info_name()
    files = [("weft/" + f, open(os.path.join(PACKAGE_DIR, f), "rb").read()) for f in _package_files()]
    files.append(("weft/" + os.path.basename(module), open(module, "rb").read()))
    files.append((dist_info + "/METADATA", _metadata().encode()))
    files.append((dist_info + "/WHEEL", _wheel_file().encode()))
    lic = os.path.join(ROOT, "LICENSE")
    if os.path.exists(lic):
        files.append((dist_info + "/LICENSE", open(lic, "rb").read()))
    record = [_record_line(arc, data) for arc, data in files] + [dist_info + "/RECORD,,"]
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel_name), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            info = zipfile.ZipInfo(arc, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
        z.writestr(dist_info + "/RECORD", "\n".join(record) + "\n")
    return wheel_name


def build_sdist(sdist_directory, config_settings=None):
    """The source tree as git tracks it (or, outside a git checkout, everything but build trees)."""
    name, version = _project()[:2]
    base = "%s-%s" % (name, version)
    try:
        files = subprocess.check_output(["git", "ls-files"], cwd=ROOT, text=True).split()
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, subdirs, names in os.walk(ROOT):
            subdirs[:] = [s for s in subdirs if s not in (".git", "build") and not s.startswith("build")]
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
    os.makedirs(sdist_directory, exist_ok=True)
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz") as t:
        for f in sorted(files):
            t.add(os.path.join(ROOT, f), arcname=os.path.join(base, f), recursive=False)
        info = tarfile.TarInfo(os.path.join(base, "PKG-INFO"))
        data = _metadata().encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return base + ".tar.gz"
