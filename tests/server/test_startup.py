"""How `tritonllm serve` starts: the address it binds and announces, and the name it serves under
(bad ports and hosts, refused before the model loads: tests/test_cli.py)."""
from server_process import ServerProcess

from tritonllm import BUNDLED_MODEL


def test_port_0_serves_on_the_port_it_announces_under_the_folders_name(tmp_path):
    # It announced port 0 (uvicorn bound another); `--model .` was served as "", its path's name as given.
    # --chat-template's file replaces the tokenizer's template for every chat.
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}={% endfor %}")
    process = ServerProcess(["--model", ".", "--chat-template", str(tmp_path / "t.jinja")], tmp_path / "log.txt",
                            port=0, cwd=BUNDLED_MODEL)
    try:
        status, body = process.request("GET", "/v1/models")
        assert status == 200 and [model["id"] for model in body["data"]] == ["bundled"]
        status, body = process.request("POST", "/tokenize", {"messages": [{"role": "user", "content": "rev ab"}]})
        status_text, text = process.request("POST", "/tokenize", {"prompt": "rev ab=", "add_special_tokens": False})
        assert status == status_text == 200 and body["tokens"] == text["tokens"]
    finally:
        process.stop()
