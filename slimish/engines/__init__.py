"""The engine boundary: everything that starts, watches or speaks HTTP to an SGLang engine or the sglang-router.

  client.py        EngineClient: one engine's control calls (weight updates, checksums, pause / continue / abort,
                   health probes); EngineError for every failure
  generation.py    GenerationClient: /generate through the router and control calls to many engines at once (async)
  router.py        RouterClient: the router's worker list (add, remove, wait until registered)
  server.py        EngineProcess: one engine's server process (or one node part of an engine spanning nodes), in
                   the Ray actor its placement slot holds
  servers.py       EngineServers: the engines (each one unit whatever its node parts) and the router, started,
                   restarted and stopped together
  engine_set.py    EngineSet: each engine's state (live, restarting, joining, failed), read by all, with a signal
  watchdog.py      EngineWatchdog: finds dead and hung engines, restarts them, moves their states
  process.py       ManagedProcess: a server process group we started, stopped by PID
  launch_router.py the router's launcher, the job's key from the environment
  timeouts.py      the named bounds of every wait above

Nothing outside this package speaks HTTP to an engine or the router (`make lint` checks it).
"""
