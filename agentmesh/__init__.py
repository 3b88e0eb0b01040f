"""agentmesh: a gRPC microservice mesh for agents that call other agents (docs/architecture.md).

One import root: `agentmesh.services.*`, `agentmesh.gateway` and `agentmesh.libs` are the top-level
folders services/, gateway/ and libs/ of the repository, mapped by the build (pyproject.toml); the
protobuf code generated from protos/ is `agentmesh.<package>.v1`. Importing this package does nothing.
"""

__version__ = "0.1.0"
