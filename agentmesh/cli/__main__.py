"""`python -m agentmesh.cli`: the `agentmesh` command (how `agentmesh up` starts its children)."""

import sys

from agentmesh.cli import main

sys.exit(main())
