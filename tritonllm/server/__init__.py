"""`tritonllm serve`: an OpenAI-compatible HTTP server over the engine. app.py: routes and streams;
protocol.py: requests into SamplingParams; fields.py: single fields' checks and the error shape;
chat_body.py: a chat's messages into prompt text, /tokenize and /detokenize; render.py: responses;
reply.py: chat replies' reasoning and tool calls apart from their content; engine_loop.py: the server's
side of the engine's process and the per-request streams; engine_process.py: the engine's process."""
