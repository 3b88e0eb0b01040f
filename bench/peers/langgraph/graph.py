"""The LangGraph peer of `make bench-peers`: one node that streams one ChatOpenAI reply from the same
scripted model server the mesh uses (OPENAI_BASE_URL, set by the harness)."""

from __future__ import annotations

import os

from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph

llm = ChatOpenAI(
    model=os.environ.get("BENCH_MODEL", "mock-gpt"),
    base_url=os.environ["OPENAI_BASE_URL"],
    api_key=os.environ.get("OPENAI_API_KEY", "bench"),
    streaming=True,
    max_retries=0,
    timeout=120,
)


async def call_model(state: MessagesState) -> dict[str, list]:
    return {"messages": [await llm.ainvoke(state["messages"])]}


builder = StateGraph(MessagesState)
builder.add_node("model", call_model)
builder.add_edge(START, "model")
graph = builder.compile()
