"""The frontend's engine room: what turns prompts into core requests and core outputs into results.

llm.py                 LLM: the offline API (generate, chat, beam search)
llm_engine.py          LLMEngine: the synchronous engine over an in-process or a separate core
async_engine.py        AsyncEngine: the HTTP server's engine, one output stream per request
core_client.py         starts the core process and talks to it
input_processor.py     prompt -> EngineCoreRequest (tokenize, validate, grammar check)
output_processor.py    EngineCoreOutputs -> RequestOutput (detokenizer.py, stop strings)
beam_search.py         beam search over single engine steps
grammar_check.py       grammars compiled in a child process with time and size budgets
"""
