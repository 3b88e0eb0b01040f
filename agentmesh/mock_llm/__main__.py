"""`python -m agentmesh.mock_llm`."""

import sys

from agentmesh.mock_llm import main

sys.exit(main())
