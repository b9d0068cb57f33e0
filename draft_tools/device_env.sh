# Sourced by the device scripts (bash, run from the repository root): the wheels the GPU machine lacks
# (.whl/, and .whl2/ where present: pyzmq, msgspec, ...) into /tmp/site, and PYTHONPATH set to them
# and this checkout; ``left`` (the seconds a task may still run before the script's ``limit``);
# ``take_prebuilt`` and ``ship_back``: a compiled extension carried between calls as compressed parts.
# Returns 1 when wheels are there but do not install.
wheels=$(shopt -s nullglob; echo .whl/*.whl .whl2/*.whl)
if [ -n "$wheels" ]; then
    # shellcheck disable=SC2086  # one word per wheel
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
        || return 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
left() { local s=$((limit - SECONDS)); echo $((s > 1 ? s : 1)); }  # timeout 0 would mean none
# take_prebuilt PARTS DEST: the parts PARTS* (a previous call's ship_back, carried) unpacked into DEST;
# false when there are none
take_prebuilt() {
    compgen -G "$1*" >/dev/null || return 1
    mkdir -p "$(dirname "$2")" && cat "$1"* | python3 -c "
import gzip, lzma, sys
d = sys.stdin.buffer.read()
sys.stdout.buffer.write(lzma.decompress(d) if d[:1] == b'\xfd' else gzip.decompress(d))" > "$2"
}
# ship_back SO PARTS: SO compressed (xz, else gzip) into 15 MB parts PARTS* (the device tool's file size limit)
ship_back() {
    if command -v xz >/dev/null; then xz -T0 -6 -c "$1"; else gzip -6 -c "$1"; fi | split -b 15M - "$2" && ls -l "$1" "$2"*
}
