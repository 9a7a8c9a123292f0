# Sourced by the README scripts: wait_ready TAG URL PID LOG WHAT - until URL/readyz answers; after
# 120 s, or as soon as process PID has ended, print why (WHAT: the command) with LOG's tail and exit 1.
wait_ready() {
  local tag=$1 url=$2 pid=$3 log=$4 what=$5 start
  start=$(date +%s)
  until curl -fsS -o /dev/null "$url/readyz" 2>/dev/null; do
    if [ $(( $(date +%s) - start )) -ge 120 ] || ! kill -0 "$pid" 2>/dev/null; then
      echo "$tag: $url/readyz not reached ($what)"; tail -n 30 "$log"; exit 1
    fi
    sleep 1
  done
}
