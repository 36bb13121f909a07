"""The chat prompts of the demo's workload, shared with the end-to-end bench (`profiling.bench e2e`)."""
from __future__ import annotations

CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is to a ten-year-old.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me a short tip for learning to cook.",
    "Why is the sky blue? Keep it brief.",
    "Name two planets in our solar system.",
    "Translate 'good morning' into Spanish.",
    "Suggest a name for a friendly robot.",
    "What does a bee make?",
    "Describe a rainy day in two sentences.",
    "How many days are in a leap year?",
    "Write one sentence about a cat who loves books.",
    "What is the opposite of 'cold'?",
    "Give a one-line definition of gravity.",
)
