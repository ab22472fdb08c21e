# Sourced: holders PATTERN prints "pid<TAB>file" for every open file of every
# process whose path matches the extended regex PATTERN (an open file's path
# as /proc shows it, " (deleted)" included once its directory is gone). A
# process holdfast spawned holds its log files, <data dir>/logs/<id>.out
# and .err, open: this is how what a server left running is found.
holders() {
    local fd target
    for fd in /proc/[0-9]*/fd/*; do
        target=$(readlink "$fd" 2>/dev/null) || continue
        if [[ $target =~ $1 ]]; then
            fd=${fd#/proc/}
            printf '%s\t%s\n' "${fd%%/*}" "$target"
        fi
    done
}

# Kill (SIGKILL) every process holding a file under directory $1.
kill_holders_under() {
    local dir pid
    dir=$(realpath -m "$1")
    holders "^${dir//./\\.}/" | cut -f1 | sort -u | while read -r pid; do
        kill -KILL "$pid" 2>/dev/null || true
    done
}
