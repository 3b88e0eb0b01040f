"""The scenarios of bench/run.py, one module per family (docs/benchmarks.md says what each measures):

- streaming.py: A and B, one session at a time, targets interleaved turn by turn;
- concurrent.py: C, N concurrent sessions, one phase per target and N;
- multiagent.py: D (delegate_parallel) and F (agent-invoke, local and over A2A);
- appends/: E, trace appends per second through the trace service and beside the database's ceilings;
- federation.py: G, a trace read locally, through a peer and from its cached copy.

Targets of A to C: `direct` (the model server read straight, the baseline of every ratio), `mesh` (POST
/api/chat through `agentmesh up`) and, with --peers langgraph, `langgraph` (`langgraph dev`). All
read the same model server process in the same run; single-session scenarios interleave the
targets turn by turn (the order rotating every turn), scenario C runs one phase per target and N.

Times: "first delta" is request sent -> first text delta; a "gap" is the time between two
text-carrying events of one stream, and "gap - pace" subtracts the time the model server put
between them (tokens in the event / tokens per second); "lateness" is a token's arrival minus the
time the model server's schedule emitted it (request received, per its request log, + ttft +
(k - 1) / tokens per second for token k), so it is what everything after the model added.
"""
