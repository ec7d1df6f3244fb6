"""The bound of every wait on an engine or the router, by name. Waits that users tune are config keys
(`rollout.request_timeout_s`, `rollout.engine.startup_timeout_s`, `rollout.engine.hang_timeout_s`); these are the
rest: long enough for a healthy engine under load, short enough that a dead one is noticed."""

CONTROL_S = 60.0           # pause / continue / abort / flush_cache on one engine: answered without generating
WEIGHT_UPDATE_S = 600.0    # one weight-update call (group init, one bucket's load, checksums of every weight)
ROUTER_S = 10.0            # one call to the router's worker list
ROUTER_READY_S = 120.0     # a started router answers /readiness and lists every engine it was given
ROUTER_REGISTER_S = 60.0   # an engine added back to the router appears in its worker list
HTTP_READY_POLL_S = 10.0   # one readiness poll of a starting server
ACTOR_CALL_S = 30.0        # a quick call to an engine's Ray actor (is the process alive, its exit code)
KILL_S = 60.0              # SIGKILL an engine's process group and reap it
STOP_EXTRA_S = 15.0        # stopping engines: their grace period plus this, then their actors are killed
TELEMETRY_S = 10.0         # one engine's GPU telemetry; an engine slower than this is left out of that sample
ATTACH_RESET_S = 600.0     # resetting an attached engine: its checkpoint reloaded from disk
# How long an idle connection to an engine is kept for reuse: well under the engine's own keep-alive (uvicorn's
# timeout_keep_alive, SGLang's SGLANG_TIMEOUT_KEEP_ALIVE, 5 s by default), so that a call is never sent on a
# connection the engine is closing that moment. With httpx's default (5 s, the same as the engine's), a call made
# ~5 s after the last one (a weight sync one step after the previous) could land as the engine closed the
# connection: "Connection reset by peer", and a sync failed with every engine alive.
KEEPALIVE_S = 2.0
