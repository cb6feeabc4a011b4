"""`kvplane up`: a whole local fleet as child processes, from YAML or embedded defaults.

Each member is one `kvplane <group> serve` process with its own config (checked when the
fleet file is loaded, then written to a private temporary folder) listening on a port it
picks; a member's config may name another member's address as `${name}`, filled in once that
member is listening. A member starts as soon as the
members it names are healthy (the engines all at once, then the controller) and is waited for
until its health service answers SERVING (a controller, also until it has tried each of its
engines once: before that it routes nothing). A planner member is a `kvplane planner run`
process, registering engines of its own with the fleet's controller: it is waited for until
the controller routes to its pools' minimum of engines, and stopped before anything else.
Every channel up opens to a member (readiness, the live status, the drain, the check) is
insecure, or TLS per the fleet's `client_tls`, and
carries the bearer token of `client_token_file` when the fleet names one. A controller
without `metrics_listen` gets one on a free port (the live status reads its routing counters
there). Then every address is printed and a live
status (engines' health, load, KV usage, cached and indexed blocks; the index size; the
routing hit ratio and decisions) is refreshed every second until Ctrl-C (or SIGTERM), which
stops the planners (each takes its engines out of the controller and stops them: one still
running would replace the engines being drained), then drains the controllers and engines at
once (a short deadline, then what is left is aborted;
a drained controller refuses new requests itself), stops every member in
reverse order with SIGTERM, and kills what is still running (with its process group) after a
grace period. A member that exits on its own is reported (its log's last lines) and the rest
are stopped the same way: up then exits 1. On Linux the members get SIGTERM when up dies, even
by SIGKILL. The folder (member configs and logs) is removed at the end, except after a
failure once a member has started (kept for its logs, its path logged); the folder a failed or
SIGKILLed run leaves behind is removed by the next `kvplane up`.

The modules: `config` (the fleet file and the embedded defaults), `fleet` (starting, watching,
draining and stopping the member processes), `member` (what a member does first when it
starts), `status` (the live view), `check` (`--check`'s smoke test) and `command` (the command
itself: signals, the live view or the check, stopping).
"""
