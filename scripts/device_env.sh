# Sourced by every scripts/gpu_*.sh, from the tree's root: the environment of a device call.
#
#   source scripts/device_env.sh NAME     # $OUT defaults to /tmp/NAME
#
# Nothing can be installed from a registry on the GPU machine, so what it lacks is carried:
# a tarball of site-packages in .site/site.tar.xz (Ray, NIXL, msgpack: scripts/pack_site.sh),
# or wheels in .whl/. Both are unpacked beside the tree and put on PYTHONPATH, ahead of the
# machine's own packages and behind the tree. Sets PY (the interpreter) and OUT (made here).
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/$1}"
mkdir -p "$OUT"
# never NVLink multicast on the lent machines (it can take the host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
_site="${TMPDIR:-/tmp}/refit-site"
if [ -f .site/site.tar.xz ]; then
  mkdir -p "$_site" && "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="fully_trusted")' \
    .site/site.tar.xz "$_site" && export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}"
fi
for _wheel in .whl/*.whl; do
  [ -f "$_wheel" ] || continue
  mkdir -p "$_site" && "$PY" -m zipfile -e "$_wheel" "$_site" || continue
  case ":${PYTHONPATH:-}:" in *":$_site:"*) ;; *) export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset _site _wheel
