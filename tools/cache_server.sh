#!/usr/bin/env bash
# A Bazel remote cache on loopback: nginx (Debian's package, installed when
# missing, as tools/bazel installs Bazel) answering GET and WebDAV PUT under
# /ac/ and /cas/ -- all that Bazel's HTTP cache protocol needs -- from a
# storage folder of its own. `--config=remote-cache` (.bazelrc) points at it.
#
#   tools/cache_server.sh start|stop|status
#   PAGODA_CACHE_DIR=DIR    entries, config, log and pid (default ~/.cache/pagoda/remote-cache)
#   PAGODA_CACHE_PORT=PORT  the port on 127.0.0.1 (default 8080, as --config=remote-cache)
#
# Entries are never evicted: stop the server and delete DIR/data to empty it.
set -euo pipefail

dir="${PAGODA_CACHE_DIR:-${HOME}/.cache/pagoda/remote-cache}"
port="${PAGODA_CACHE_PORT:-8080}"
url="http://127.0.0.1:${port}"
pid_file="${dir}/nginx.pid"

die() { echo "tools/cache_server.sh: $*" >&2; exit 1; }

running_pid() {  # the server's pid, if it is running
  local pid
  pid="$(cat "${pid_file}" 2>/dev/null || true)"
  if [[ -n "${pid}" ]] && kill -0 "${pid}" 2>/dev/null; then echo "${pid}"; fi
}

find_nginx() {
  local candidate
  for candidate in "$(command -v nginx || true)" /usr/sbin/nginx; do
    if [[ -n "${candidate}" && -x "${candidate}" ]]; then echo "${candidate}"; return; fi
  done
}

install_nginx() {
  echo "tools/cache_server.sh: installing Debian's nginx ..." >&2
  local sudo_cmd=()
  [[ "$(id -u)" == 0 ]] || sudo_cmd=(sudo)
  { "${sudo_cmd[@]}" apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq nginx; } >/tmp/pagoda-apt.log 2>&1 \
    || die "could not install nginx through apt (is the Debian mirror reachable? log: /tmp/pagoda-apt.log)"
}

write_config() {
  # Workers run as the caller (nginx would otherwise drop root to nobody,
  # who cannot write the storage folder). PUT bodies land in tmp/ and are
  # renamed into data/, so a reader never sees half an entry.
  local user_line=""
  [[ "$(id -u)" != 0 ]] || user_line="user $(id -un) $(id -gn);"
  cat >"${dir}/nginx.conf" <<EOF
${user_line}
worker_processes 2;
pid ${pid_file};
error_log ${dir}/error.log warn;
events { worker_connections 256; }
http {
    access_log off;
    client_body_temp_path ${dir}/tmp/body;
    proxy_temp_path ${dir}/tmp/proxy;
    fastcgi_temp_path ${dir}/tmp/fastcgi;
    uwsgi_temp_path ${dir}/tmp/uwsgi;
    scgi_temp_path ${dir}/tmp/scgi;
    server {
        listen 127.0.0.1:${port};
        root ${dir}/data;
        client_max_body_size 0;
        # A miss is a 404, not an error worth a log line.
        log_not_found off;
        location ~ "^/(ac|cas)/[0-9a-f]{64}\$" {
            limit_except GET PUT { deny all; }
            dav_methods PUT;
            create_full_put_path on;
        }
        location / { return 404; }
    }
}
EOF
}

start() {
  if [[ -n "$(running_pid)" ]]; then
    echo "cache server already running: ${url} (storage ${dir}/data)"
    return
  fi
  local nginx
  nginx="$(find_nginx)"
  if [[ -z "${nginx}" ]]; then
    install_nginx
    nginx="$(find_nginx)"
    [[ -n "${nginx}" ]] || die "nginx installed but no nginx binary found"
  fi
  mkdir -p "${dir}/data" "${dir}/tmp"
  write_config
  "${nginx}" -q -p "${dir}" -e "${dir}/error.log" -c "${dir}/nginx.conf" \
    || die "nginx did not start on ${url} (port taken? set PAGODA_CACHE_PORT); log: ${dir}/error.log"
  local probe="${url}/ac/$(printf '0%.0s' {1..64})"
  for _ in $(seq 50); do
    # An empty cache answers a lookup with 404: the server is up.
    if [[ "$(curl -s -o /dev/null -w '%{http_code}' "${probe}" || true)" == 404 ]]; then
      echo "cache server running: ${url} (storage ${dir}/data)"
      return
    fi
    sleep 0.1
  done
  stop >/dev/null
  die "nginx started but does not answer on ${url}; log: ${dir}/error.log"
}

stop() {
  local pid
  pid="$(running_pid)"
  if [[ -z "${pid}" ]]; then
    echo "cache server not running (${dir})"
    return
  fi
  kill -TERM "${pid}"
  for _ in $(seq 50); do
    if ! kill -0 "${pid}" 2>/dev/null; then
      echo "cache server stopped"
      return
    fi
    sleep 0.1
  done
  die "nginx (pid ${pid}) did not stop"
}

status() {
  if [[ -n "$(running_pid)" ]]; then
    echo "cache server running: ${url} (storage ${dir}/data, $(du -sh "${dir}/data" | cut -f1))"
  else
    echo "cache server not running (${dir})"
    return 3
  fi
}

case "${1:-}" in
  start|stop|status) "$1" ;;
  *) die "usage: tools/cache_server.sh start|stop|status" ;;
esac
