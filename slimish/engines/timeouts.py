"""The bound of every wait on an engine or the router, by name. Waits that users tune are config keys
(`rollout.request_timeout_s`, `rollout.engine.startup_timeout_s`, `rollout.engine.hang_timeout_s`); these are the
rest: long enough for a healthy engine under load, short enough that a dead one is noticed."""

CONTROL_S = 60.0           # pause / continue / abort / flush_cache on one engine: answered without generating
WEIGHT_UPDATE_S = 600.0    # one weight-update call (group init, one bucket's load, checksums of every weight)
ROUTER_S = 10.0            # one call to the router's worker list
ROUTER_READY_S = 120.0     # a started router answers /readiness and lists every engine it was given
ROUTER_REGISTER_S = 60.0   # an engine added back to the router appears in its worker list
HTTP_READY_POLL_S = 10.0   # one readiness poll of a starting server
ROUTER_POLL_S = 0.1        # between looks at a starting router (on loopback, cheap): a job's start waits on them
ACTOR_CALL_S = 30.0        # a quick call to an engine's Ray actor (is the process alive, its exit code)
KILL_S = 60.0              # SIGKILL an engine's process group and reap it
STOP_EXTRA_S = 15.0        # stopping engines: their grace period plus this, then their actors are killed
TELEMETRY_S = 10.0         # one engine's GPU telemetry; an engine slower than this is left out of that sample
ATTACH_RESET_S = 600.0     # resetting an attached engine: its checkpoint reloaded from disk
# Control calls to an engine use a new connection each (`client.CONTROL_LIMITS`): none is kept idle between calls.
# A kept one races the engine's own keep-alive close (uvicorn's timeout_keep_alive, SGLang's SGLANG_TIMEOUT_KEEP_ALIVE,
# 5 s): a call sent on it as the engine closes it fails with "Connection reset by peer", and a weight sync with it,
# every engine alive (a calculator job, its syncs ~5 s apart). Expiring them sooner than the engine only narrows the
# race: under load the client may read a reply, and start its idle clock, seconds after the engine sent it.
