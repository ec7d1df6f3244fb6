"""Ray placement and actor groups, and the job driver.

Set here, before any module of the package imports Ray: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is read by Ray at import
time, and with it a local Ray advertises and binds 127.0.0.1 instead of the host's interface address. A multi-node
cluster is joined through RAY_ADDRESS and keeps Ray's defaults.
"""

import os

if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
