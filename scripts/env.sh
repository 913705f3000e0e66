# Sourced (not run) by the other scripts: the environment tritonserver, its Python backend stub,
# perf_analyzer and the tests need. Safe to source before scripts/setup.sh has run (paths are
# exported all the same; the Python-derived ones are filled in once the venv exists).
#
#   PATH             the venv's bin first: the backend stub finds the venv (torch, numpy<2)
#                    through `python3` on PATH; then build/tritonserver/bin (`tritonserver` by hand).
#   LD_LIBRARY_PATH  nvidia_pytriton.libs (tritonserver's own libraries), the interpreter's LIBDIR
#                    (the stub embeds libpython; without this it picks Debian's libpython 3.11.2
#                    and fails oddly), and build/tritonserver/lib (libb64.so.0d, libcudart.so.12
#                    for perf_analyzer).

DSV4_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DSV4_REPO_ROOT
export DSV4_VENV="$DSV4_REPO_ROOT/.venv"
# TRITON_HOME and PERF_ANALYZER set beforehand are kept (a machine given them apart: scripts/pack_serving.sh).
export TRITON_HOME="${TRITON_HOME:-$DSV4_REPO_ROOT/build/tritonserver}"
export TRITON_BIN="$TRITON_HOME/bin/tritonserver"
export TRITON_BACKEND_DIR="$TRITON_HOME/backends"
export PERF_LIB_DIR="$TRITON_HOME/lib"
export PERF_ANALYZER="${PERF_ANALYZER:-$DSV4_VENV/bin/perf_analyzer}"

for _dsv4_bin in "$TRITON_HOME/bin" "$DSV4_VENV/bin"; do  # (the venv's ends up first)
  case ":$PATH:" in
    *":$_dsv4_bin:"*) ;;
    *) export PATH="$_dsv4_bin:$PATH" ;;
  esac
done
unset _dsv4_bin

_dsv4_libs="$PERF_LIB_DIR"  # (without the venv: where a machine given the server's libraries has them)
if [ -x "$DSV4_VENV/bin/python" ]; then
  # One interpreter call: site-packages and the directory of libpython (tab-separated: paths may hold spaces).
  IFS=$'\t' read -r DSV4_SITE_PACKAGES DSV4_PYTHON_LIBDIR < <(
    "$DSV4_VENV/bin/python" -c 'import sysconfig as s; print(s.get_paths()["purelib"], s.get_config_var("LIBDIR"), sep="\t")'
  )
  export DSV4_SITE_PACKAGES DSV4_PYTHON_LIBDIR
  _dsv4_libs="$DSV4_SITE_PACKAGES/nvidia_pytriton.libs:$DSV4_PYTHON_LIBDIR:$PERF_LIB_DIR"
fi
case ":${LD_LIBRARY_PATH:-}:" in
  *":$_dsv4_libs:"*) ;;
  *) export LD_LIBRARY_PATH="$_dsv4_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
unset _dsv4_libs
