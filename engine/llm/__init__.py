"""The front end a vLLM or Hugging Face user reaches for: `LLM` (built once, text in,
`RequestOutput`s out, streaming) above the decode loop."""
from engine.llm.llm import LLM, EmptyCompletionWarning, StartupTimes, Stream
from engine.llm.request_output import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "StartupTimes", "Stream", "EmptyCompletionWarning", "RequestOutput", "CompletionOutput", "Logprob"]
