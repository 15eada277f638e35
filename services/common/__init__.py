"""Libraries that more than one stage uses: the text tokenizer and chat templates (`text`), the
tools prompt and tool-call parsing (`tools_prompt`, `tool_parsers`), and grammar compilation for
structured output (`grammar_compiler`). Stage folders import these and `ipc/`, never each other
(docs/architecture.md invariant 10)."""
