#!/usr/bin/env bash
# Start or stop the services a scaled-out run uses, on one machine, bound to 127.0.0.1 only:
#   postgres  PostgreSQL 15 (a new cluster in FOLDER/pg; databases "mlflow" and "optuna"); TCP clients
#             authenticate with a generated password (scram-sha-256, kept in FOLDER/pgpass, mode 600,
#             found through PGPASSFILE), the Unix socket with peer authentication
#   mlflow    `mlflow server` on that PostgreSQL, artifacts in FOLDER/artifacts (needs postgres)
#   slurm     a single-node Slurm (munged on a Unix socket only; slurmctld and slurmd bound to
#             127.0.0.1 by CommunicationParameters=NoCtldInAddrAny,NoInAddrAny) with FOLDER/slurm/slurm.conf
#
# Usage:
#   bash scripts/services.sh start FOLDER [postgres] [mlflow] [slurm]   # default: all three
#   source FOLDER/env.sh      # MLFLOW_TRACKING_URI, BENCHX_POSTGRES_URL, BENCHX_OPTUNA_STORAGE, PGPASSFILE, SLURM_CONF
#   bash scripts/services.sh stop FOLDER
#
# Environment: HOST (default 127.0.0.1; another address exposes PostgreSQL and MLflow, still with
# the password, to the hosts of that network, see docs/scaling.md; the test Slurm stays on loopback),
# PYTHON (the Python that has mlflow and psycopg; default .venv/bin/python, else python3),
# MLFLOW_WORKERS (default 1: gunicorn workers of the server; raise on a real server).
# Debian packages: postgresql, slurm-wlm, munge (.ci/setup installs them). Every process is
# stopped by its PID or pg_ctl/scontrol, never by name. initdb refuses to run as root, so under
# root PostgreSQL runs as the postgres user (FOLDER and its parents must be o+x).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
HOST="${HOST:-127.0.0.1}"
PYTHON="${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}"
PGBIN="${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}"

die() { echo "services.sh: $*" >&2; exit 1; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
as_service_user() {  # as_service_user USER COMMAND...: run as USER when we are root, else as ourselves
  local user="$1"; shift
  if [ "$(id -u)" = 0 ]; then runuser -u "$user" -- "$@"; else "$@"; fi
}
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit="$1" what="$2"; shift 2
  for _ in $(seq $((limit * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up within ${limit}s"
}
env_line() { echo "export $1=$2" >>"$DIR/env.sh"; export "$1=$2"; }

start_postgres() {
  [ -x "$PGBIN/initdb" ] || die "PostgreSQL not found (apt-get install postgresql)"
  "$PYTHON" -c "import psycopg" 2>/dev/null || die "$PYTHON has no psycopg: pip install -e '.[server]'"
  local port; port="$(free_port)"
  mkdir -p "$DIR/pg"
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- test -x "$DIR" || die "the postgres user cannot enter $DIR: make it and its parents o+x"
    chown postgres:postgres "$DIR/pg"
  fi
  chmod 700 "$DIR/pg"
  # The superuser's password: only in the pgpass file of whoever started the services (libpq and
  # psycopg read it through PGPASSFILE), never on a command line or in a URL.
  local password; password="$("$PYTHON" -c 'import secrets; print(secrets.token_hex(24))')"
  (umask 077; printf '%s\n' "$password" >"$DIR/pg/pwfile")
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$DIR/pg/pwfile"
  (umask 077; printf '%s:%s:*:postgres:%s\n' "$HOST" "$port" "$password" >"$DIR/pgpass")
  as_service_user postgres "$PGBIN/initdb" -D "$DIR/pg/data" -U postgres --pwfile="$DIR/pg/pwfile" \
    --auth-host=scram-sha-256 --auth-local=peer -E UTF8 --locale=C.UTF-8 >"$DIR/pg/initdb.log"
  rm -f "$DIR/pg/pwfile"
  case "$HOST" in
    127.*|localhost|::1) ;;
    # initdb's pg_hba.conf admits loopback clients only; an exposed server admits its network, by password.
    *) echo "host all all samenet scram-sha-256" | as_service_user postgres tee -a "$DIR/pg/data/pg_hba.conf" >/dev/null ;;
  esac
  as_service_user postgres "$PGBIN/pg_ctl" -D "$DIR/pg/data" -l "$DIR/pg/server.log" -w start \
    -o "-c listen_addresses=$HOST -c port=$port -c unix_socket_directories=$DIR/pg -c max_connections=400" >/dev/null
  env_line PGPASSFILE "$DIR/pgpass"
  for db in mlflow optuna; do psql -q -h "$HOST" -p "$port" -U postgres -d postgres -c "CREATE DATABASE $db"; done
  env_line BENCHX_POSTGRES_URL "postgresql://postgres@$HOST:$port"
  env_line BENCHX_OPTUNA_STORAGE "postgresql+psycopg://postgres@$HOST:$port/optuna"
  echo "postgres: $BENCHX_POSTGRES_URL (password in PGPASSFILE=$PGPASSFILE; databases mlflow, optuna; log $DIR/pg/server.log)"
}

start_mlflow() {
  [ -n "${BENCHX_POSTGRES_URL:-}" ] || die "mlflow needs postgres: start postgres first (same FOLDER)"
  local port; port="$(free_port)"
  mkdir -p "$DIR/artifacts"
  # Small machines: one gunicorn worker and no job-execution workers (13 processes by default).
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$PYTHON" -m mlflow server \
    --backend-store-uri "${BENCHX_POSTGRES_URL/postgresql:/postgresql+psycopg:}/mlflow" \
    --artifacts-destination "$DIR/artifacts" --host "$HOST" --port "$port" \
    --workers "${MLFLOW_WORKERS:-1}" >"$DIR/mlflow.log" 2>&1 </dev/null &
  echo $! >"$DIR/mlflow.pid"
  wait_for 120 "mlflow server (log $DIR/mlflow.log)" curl -sf "http://$HOST:$port/health"
  env_line MLFLOW_TRACKING_URI "http://$HOST:$port"
  echo "mlflow: $MLFLOW_TRACKING_URI (artifacts $DIR/artifacts; log $DIR/mlflow.log)"
}

write_slurm_conf() {
  local node; node="$(hostname -s)"
  cat >"$DIR/slurm/slurm.conf" <<EOF
ClusterName=benchx
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$1
SlurmdPort=$2
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Listen on the SlurmctldHost and NodeAddr address (127.0.0.1) instead of every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
# cred_expire: the default 120 s would delay a requeued job's restart by two minutes.
AuthInfo=socket=$DIR/munge/munge.sock,cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=$DIR/slurm/state
SlurmdSpoolDir=$DIR/slurm/spool
SlurmctldPidFile=$DIR/slurm/slurmctld.pid
SlurmdPidFile=$DIR/slurm/slurmd.pid
SlurmctldLogFile=$DIR/slurm/slurmctld.log
SlurmdLogFile=$DIR/slurm/slurmd.log
SchedulerType=sched/backfill
# A requeued job is held until its BeginTime (cred_expire after the requeue) and then waits for the
# next scheduling pass: by default the main loop every 60 s or backfill every 30 s (it started 23 and
# 68 s after the requeue). Passes every 2 s and 1 s start it when the hold ends (11 s after it).
SchedulerParameters=bf_interval=1,sched_interval=2
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc)
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

start_slurm() {
  command -v slurmctld >/dev/null || die "Slurm not found (apt-get install slurm-wlm munge)"
  [ "$(id -u)" = 0 ] || die "the test Slurm runs its daemons as root"
  mkdir -p "$DIR/munge" "$DIR/slurm/state" "$DIR/slurm/spool"
  chown munge:munge "$DIR/munge"; chmod 755 "$DIR/munge"
  runuser -u munge -- mungekey --create --keyfile="$DIR/munge/munge.key"
  runuser -u munge -- munged --socket="$DIR/munge/munge.sock" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  write_slurm_conf "$(free_port)" "$(free_port)"
  env_line SLURM_CONF "$DIR/slurm/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  wait_for 30 "the Slurm node" bash -c "sinfo -h -o %T | grep -qx idle"
  echo "slurm: SLURM_CONF=$SLURM_CONF (node $(hostname -s), $(nproc) CPUs; logs in $DIR/slurm)"
}

stop_all() {
  [ -f "$DIR/env.sh" ] && source "$DIR/env.sh"
  if [ -f "$DIR/slurm/slurmctld.pid" ]; then
    scontrol -f "$SLURM_CONF" shutdown >/dev/null 2>&1 || true
    for pidfile in "$DIR/slurm/slurmctld.pid" "$DIR/slurm/slurmd.pid"; do
      [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
  fi
  [ -f "$DIR/munge/munged.pid" ] && kill "$(cat "$DIR/munge/munged.pid")" 2>/dev/null || true
  if [ -f "$DIR/mlflow.pid" ]; then  # the server's process group (gunicorn and its workers)
    kill -- "-$(cat "$DIR/mlflow.pid")" 2>/dev/null || true
    rm -f "$DIR/mlflow.pid"
  fi
  if [ -f "$DIR/pg/data/postmaster.pid" ]; then
    as_service_user postgres "$PGBIN/pg_ctl" -D "$DIR/pg/data" -m fast -w stop >/dev/null || true
  fi
  echo "services in $DIR stopped"
}

[ $# -ge 2 ] || die "usage: $0 start|stop FOLDER [postgres] [mlflow] [slurm]"
ACTION="$1"; DIR="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2
case "$ACTION" in
  start)
    chmod o+x "$DIR"
    [ $# -gt 0 ] || set -- postgres mlflow slurm
    : >"$DIR/env.sh"
    for service in "$@"; do
      case "$service" in
        postgres|mlflow|slurm) "start_$service" ;;
        *) die "unknown service '$service' (postgres, mlflow, slurm)" ;;
      esac
    done
    echo "source $DIR/env.sh   # then: bash $0 stop $DIR" ;;
  stop) stop_all ;;
  *) die "unknown action '$ACTION' (start, stop)" ;;
esac
