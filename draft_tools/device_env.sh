# Sourced by the device scripts (bash, run from the repository root): the wheels the GPU machine lacks
# (.whl/, and .whl2/ where present: pyzmq, msgspec, ...) into /tmp/site, and PYTHONPATH set to them
# and this checkout; ``left`` (the seconds a task may still run before the script's ``limit``).
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
