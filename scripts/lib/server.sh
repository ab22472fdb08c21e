# Sourced by scripts that run a throwaway holdfast: start_server starts
# `$bin serve` on an ephemeral loopback port with its data and log in
# `$work` and the given extra arguments, in a session of its own (so that
# whatever it spawns goes with it), waits until it listens, and sets
# `$server` (its pid and process group) and `$url`. Taking the port from
# the server's own log line means a script never talks to a server it did
# not start, whatever else listens on this machine.
start_server() {
    setsid "$bin" serve --listen 127.0.0.1:0 --data-dir "$work/data" "$@" \
        >"$work/server.log" 2>&1 &
    server=$!
    local addr=""
    for _ in $(seq 300); do
        addr=$(sed -n 's/.*holdfast listening addr=\([0-9.:]*\).*/\1/p' "$work/server.log" | head -n 1)
        [ -n "$addr" ] && break
        kill -0 "$server" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$addr" ]; then
        echo "holdfast did not start listening; its log:" >&2
        cat "$work/server.log" >&2
        return 1
    fi
    url="http://$addr"
}

source "$(dirname "${BASH_SOURCE[0]}")/holders.sh"

# Stop the server and what it spawned (each child runs in a process group
# of its own, out of reach of the server's).
stop_server() {
    kill_holders_under "$work/data/logs"
    kill -TERM -- "-$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
}
