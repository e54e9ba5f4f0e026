#!/usr/bin/env bash
# Drive mugpt on the workers of a Cloud TPU VM slice (v4-32 and up) from a laptop with gcloud:
#
#   tpu_scripts/tpu.sh create [--spot] [--queued] [-- GCLOUD_FLAGS]   on-demand by default; --queued: a queued resource
#   tpu_scripts/tpu.sh delete [--queued]      the TPU (--queued: the queued resource and its TPU)
#   tpu_scripts/tpu.sh copy                   this repo to ~/mugpt on every worker, less .git, runs/, data/, *.bin and
#                                             bytecode (fetch the data onto the workers yourself: see docs/scaling.md)
#   tpu_scripts/tpu.sh setup                  a virtual environment ~/mugpt-venv with a Python >= 3.11 on every worker,
#                                             with jax[tpu], requirements.txt and gcsfs; the verbs' python3 is then its
#   tpu_scripts/tpu.sh launch -- ARGS         python3 launch.py ARGS --multihost on every worker, detached from ssh,
#                                             logging to ~/mugpt-logs/train.log (pid in train.pid) on each worker; then,
#                                             after a few seconds, whether it still runs there (non-zero exit if not)
#   tpu_scripts/tpu.sh status                 whether launch.py runs on each worker, and its last log line
#   tpu_scripts/tpu.sh logs [WORKER]          the last 50 log lines of every worker (or of worker WORKER: 0, 1, ...)
#   tpu_scripts/tpu.sh stop                   SIGTERM to launch.py on every worker, so it checkpoints and exits
#   tpu_scripts/tpu.sh ssh -- CMD [ARG ...]   one command on every worker, in ~/mugpt when it exists; the words are
#                                             an argv, not a shell line: pipes need  ssh -- bash -c 'a | b'
#
# Settings: TPU_NAME, ZONE, PROJECT (every verb), ACCELERATOR_TYPE (e.g. v4-32) and RUNTIME_VERSION (create).
# Each comes from the environment, else from tpu_scripts/tpu.env (copy tpu.env.example): the environment wins,
# so `TPU_NAME=other tpu_scripts/tpu.sh status` needs no edit of the file. A variable set to "" counts as unset.
#
# Every remote command is one `gcloud compute tpus tpu-vm ssh/scp ... --worker=all`. The user's words are
# quoted one by one with printf %q into the --command string, so the worker's shell (bash, on the TPU VM
# images) splits it back into exactly those words: spaces, quotes and $ survive. (midGPT's launcher sent
# 'tmux new -d -s launch "$command"' in single quotes: the worker got the literal $command, empty there.)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SETTINGS=(TPU_NAME ZONE PROJECT ACCELERATOR_TYPE RUNTIME_VERSION)
LOG_LINES=50
# launch.py checks its command line and config before it loads jax, so a typo has ended it well within this.
LAUNCH_CHECK_S=5

# On the workers, paths are relative to the home directory that ssh starts in.
# shellcheck disable=SC2016  # the $ in these single-quoted snippets is for the worker's shell, not this one
RUNNING='pid=$(cat ~/mugpt-logs/train.pid 2>/dev/null) && grep -q launch.py "/proc/$pid/cmdline" 2>/dev/null'
# RUNNING checks the command line as well as the pid, so a stale pid file reused by another process is not
# mistaken for the trainer (and `stop` never signals that process).

die() { echo "tpu.sh: $*" >&2; exit 1; }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

load_settings() {
  local name from_env
  for name in "${SETTINGS[@]}"; do printf -v "env_$name" '%s' "${!name-}"; done
  if [ -f "$ROOT/tpu_scripts/tpu.env" ]; then
    # shellcheck source=/dev/null  # the user's own settings; tpu.env.example shows the format
    source "$ROOT/tpu_scripts/tpu.env"
  fi
  for name in "${SETTINGS[@]}"; do
    from_env="env_$name"
    if [ -n "${!from_env}" ]; then printf -v "$name" '%s' "${!from_env}"; fi
  done
}

need() {
  local name
  for name in "$@"; do
    [ -n "${!name-}" ] || die "$name is not set: export it or set it in tpu_scripts/tpu.env (see tpu.env.example)"
  done
}

# no_args VERB "$@": the verb takes no arguments (a mistyped --dry-run must not go on to do the real thing).
no_args() {
  [ $# -le 1 ] || die "$1: unexpected argument '$2' (it takes none)"
}

# gcloud ARGS..., shown on stderr first so that the user sees what runs on their project.
gcloud_run() {
  { printf '+ gcloud'; printf ' %q' "$@"; echo; } >&2
  gcloud "$@"
}

# on_workers COMMAND_LINE [WORKER]: run a shell command line on every worker (or on WORKER) as it is.
on_workers() {
  gcloud_run compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker="${2:-all}" \
    --command="$1"
}

# remote COMMAND_LINE [WORKER]: the same, with the virtual environment that `setup` makes first on PATH where it
# exists, so that `python3` in the command line is its Python: the TPU VM images' own is 3.10, and jax >= 0.7
# needs 3.11. Every verb that runs on the workers comes here, but setup, which makes the environment with the
# images' python3.
remote() {
  # shellcheck disable=SC2016  # $HOME and $PATH are the worker's
  on_workers 'if [ -d "$HOME/mugpt-venv/bin" ]; then PATH="$HOME/mugpt-venv/bin:$PATH"; fi; '"$1" "${2:-all}"
}

# quote WORD...: one shell line that a POSIX/bash shell splits back into exactly these words.
quote() { local line; line=$(printf '%q ' "$@"); printf '%s' "${line% }"; }

cmd_create() {
  need ACCELERATOR_TYPE RUNTIME_VERSION
  local queued=0 flags=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --spot) flags+=(--spot) ;;
      --queued) queued=1 ;;
      --) shift; flags+=("$@"); break ;;
      *) die "create: unknown option $1 (expected --spot, --queued, or -- GCLOUD_FLAGS)" ;;
    esac
    shift
  done
  if [ "$queued" = 1 ]; then
    # A queued resource waits for capacity instead of failing; its one node gets the same name, so every
    # other verb (tpu-vm ssh/scp) addresses it as TPU_NAME.
    gcloud_run compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" --zone="$ZONE" \
      --project="$PROJECT" --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
      ${flags[@]+"${flags[@]}"}
  else
    gcloud_run compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" ${flags[@]+"${flags[@]}"}
  fi
}

cmd_delete() {
  [ $# -le 1 ] || die "delete: unexpected argument '$2' (expected --queued at most)"
  case "${1-}" in
    # --force: also delete the queued resource's node, which otherwise blocks the deletion.
    --queued) gcloud_run compute tpus queued-resources delete "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --force ;;
    "") gcloud_run compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" ;;
    *) die "delete: unknown option $1 (expected --queued)" ;;
  esac
}

cmd_copy() {
  no_args copy "$@"
  # `scp --recurse` cannot leave anything out, so pack a tarball without git, the runs, the data and bytecode,
  # send it, and unpack it over ~/mugpt. The data (GBs of token bins) reaches the workers from a bucket (README):
  # a meta.json sent without its bins would make data.py there skip preparing and fail on the missing bins, and
  # one sent with them would overwrite the workers' own. The patterns are unanchored (they match those names
  # anywhere in the tree): anchoring differs between GNU tar and macOS's bsdtar. COPYFILE_DISABLE=1 keeps macOS tar
  # from adding ._* resource-fork files. Without .git the workers cannot tell which commit they run, so
  # .mugpt_git carries it and whether the tree was dirty, for launch.py's run.json (null outside a checkout).
  # It goes in last, so it replaces any .mugpt_git in the tree when the workers unpack.
  local commit=null dirty=null head
  COPY_TMP=$(mktemp -d "${TMPDIR:-/tmp}/mugpt-copy.XXXXXX")
  trap 'rm -rf "$COPY_TMP"' EXIT
  if head=$(git -C "$ROOT" rev-parse --verify -q HEAD 2>/dev/null); then
    commit="\"$head\""
    if [ -n "$(git -C "$ROOT" status --porcelain)" ]; then dirty=true; else dirty=false; fi
  fi
  printf '{"commit": %s, "dirty": %s}\n' "$commit" "$dirty" > "$COPY_TMP/.mugpt_git"
  COPYFILE_DISABLE=1 tar -czf "$COPY_TMP/mugpt.tar.gz" -C "$ROOT" \
    --exclude=.git --exclude=runs --exclude=data --exclude='*.bin' --exclude=__pycache__ . -C "$COPY_TMP" .mugpt_git
  gcloud_run compute tpus tpu-vm scp "$COPY_TMP/mugpt.tar.gz" "$TPU_NAME:mugpt.tar.gz" --zone="$ZONE" \
    --project="$PROJECT" --worker=all
  remote 'mkdir -p ~/mugpt && tar -xzf ~/mugpt.tar.gz -C ~/mugpt && rm ~/mugpt.tar.gz'
}

cmd_setup() {
  no_args setup "$@"
  # The TPU VM images (Ubuntu 22.04) have Python 3.10; jax >= 0.7 needs 3.11. uv makes the virtual environment
  # with an installed Python that satisfies '>=3.11', else with a standalone build it downloads. It is made only
  # where it is missing (uv refuses an existing one without --clear), then uv installs into it in one resolution,
  # so jax[tpu]'s jaxlib and libtpu match requirements.txt's jax; gcsfs: gs:// run directories need it.
  # python3 -m: the images have neither `python` nor always ~/.local/bin on PATH.
  on_workers "cd ~/mugpt && python3 -m pip install --user uv && \
{ [ -x ~/mugpt-venv/bin/python ] || python3 -m uv venv --python '>=3.11' ~/mugpt-venv; } && \
python3 -m uv pip install --python ~/mugpt-venv/bin/python 'jax[tpu]' -r requirements.txt gcsfs"
}

cmd_launch() {
  if [ "${1-}" = -- ]; then shift; fi
  [ $# -gt 0 ] || die "launch: give launch.py's arguments after --, e.g. launch -- --config=openwebtext"
  # setsid + nohup + all three streams redirected: the trainer outlives the ssh session, which ends once the
  # check below is done. The inner bash writes its own pid and execs python, so train.pid holds launch.py's pid.
  # Then a worker whose launch.py has already exited (a typo, a missing package) prints its log's last lines,
  # where a traceback ends, and exits 1, so that launch exits non-zero.
  remote "if $RUNNING; then echo \"\$HOSTNAME: launch.py is already running (pid \$pid)\" >&2; exit 1; fi; \
mkdir -p ~/mugpt-logs && cd ~/mugpt && echo \"== \$(date)\" >> ~/mugpt-logs/train.log && \
{ setsid nohup bash -c 'echo \$\$ > ~/mugpt-logs/train.pid && exec \"\$@\"' mugpt \
$(quote python3 launch.py "$@" --multihost) >> ~/mugpt-logs/train.log 2>&1 < /dev/null & } && \
sleep $LAUNCH_CHECK_S && if $RUNNING; then echo \"\$HOSTNAME: launch.py is running (pid \$pid)\"; \
else echo \"\$HOSTNAME: launch.py exited within $LAUNCH_CHECK_S s; the end of ~/mugpt-logs/train.log:\"; \
$(log_tail 10); exit 1; fi"
}

# log_tail N: a line for the worker's shell that prints the last N lines of its log, each after its host
# name. tqdm redraws its bar with \r on one line, so only the last redraw of each line is kept, as a
# terminal would show it; reading only the log's last MB bounds the work.
# shellcheck disable=SC2016  # for the worker's shell
log_tail() {
  printf '%s' 'tail -c 1000000 ~/mugpt-logs/train.log 2>/dev/null | tail -n '"$1"' | '
  printf '%s' 'awk -F "\r" "{ print \"$HOSTNAME: \" \$NF }"'
}

cmd_status() {
  no_args status "$@"
  remote "if $RUNNING; then echo \"\$HOSTNAME: running, pid \$pid\"; else echo \"\$HOSTNAME: not running\"; fi; \
$(log_tail 1)"
}

cmd_logs() {
  [ $# -le 1 ] || die "logs: unexpected argument '$2' (it takes one worker number at most)"
  [[ "${1-0}" =~ ^[0-9]+$ ]] || die "logs: the worker is a number (0, 1, ...), not '$1'"
  remote "$(log_tail "$LOG_LINES")" "${1:-all}"
}

cmd_stop() {
  no_args stop "$@"
  # The trainer checkpoints on SIGTERM, the signal a preempted or stopped VM gets too.
  remote "if $RUNNING; then kill -TERM \"\$pid\" && echo \"\$HOSTNAME: sent SIGTERM to launch.py, pid \$pid\"; \
else echo \"\$HOSTNAME: launch.py is not running\"; fi"
}

cmd_ssh() {
  if [ "${1-}" = -- ]; then shift; fi
  [ $# -gt 0 ] || die "ssh: give a command after --, e.g. ssh -- nproc"
  remote "cd ~/mugpt 2>/dev/null; $(quote "$@")"
}

main() {
  local verb=${1-}
  if [ $# -gt 0 ]; then shift; fi
  case "$verb" in
    create | delete | copy | setup | launch | status | logs | stop | ssh)
      command -v gcloud >/dev/null || die "gcloud is not on PATH: install the Google Cloud CLI \
(https://cloud.google.com/sdk/docs/install)"
      load_settings
      need TPU_NAME ZONE PROJECT
      "cmd_$verb" "$@"
      ;;
    "" | -h | --help | help) usage ;;
    *) die "unknown verb '$verb' (see tpu_scripts/tpu.sh --help)" ;;
  esac
}

main "$@"
