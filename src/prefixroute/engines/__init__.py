"""Real inference engines behind the router: llama.cpp instances on a generated tiny model (docs/LLAMA_CPP.md)."""
