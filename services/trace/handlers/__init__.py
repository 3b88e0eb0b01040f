"""The trace domain: one handler per resource (traces, messages, A2A tasks, subagents, agents) that
applies the rules of services/trace/domain.py and calls a store (services/trace/store/base.py)."""
