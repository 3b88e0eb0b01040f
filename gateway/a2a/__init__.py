"""Every public agent of the mesh as an A2A v1.0 server, built on the official a2a-sdk: its
DefaultRequestHandler with our AgentExecutor (`executor.py`: an inbound task is a child turn through
the orchestrator, streaming on `a2a:<task id>`) and our TaskStore (`store.py`: the trace service's
A2A tasks), mounted by the SDK's JSON-RPC dispatcher at `POST /a2a/{slug}` (`routes.py`) and by its
gRPC handlers on the gateway's A2A gRPC port (`grpc_server.py`). `handler.py` adds what A2A lacks:
SubscribeToTask replays from our buffer and resumes after an offset, and CancelTask reaches the turn on
whichever gateway replica runs it."""
