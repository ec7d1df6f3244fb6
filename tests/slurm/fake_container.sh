#!/usr/bin/env bash
# A stand-in for a container runtime (`apptainer exec --nv IMAGE`, `enroot start ...`) as launch/train.sbatch's
# SLIMISH_EXEC: it logs the command it was given, then runs it the way a process in the image would find things: the
# image's Python first on PATH (this repository's venv, named by FAKE_CONTAINER_VENV) and IN_FAKE_CONTAINER=1 in the
# environment. Only the runtime itself is stood in for; the job's commands run as they are.
set -euo pipefail
echo "${SLURMD_NODENAME:-?} $*" >>"$FAKE_CONTAINER_LOG"
export PATH="$FAKE_CONTAINER_VENV/bin:$PATH" IN_FAKE_CONTAINER=1
exec "$@"
