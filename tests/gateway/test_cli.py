"""The user commands (generate, load, unload, list, info) against a real gateway server."""
import asyncio
import json

from loraplex.cli.main import main
from loraplex.formats import adapter_from_tensors, write_llgtrt, write_npy_dir
from gateway_fakes import SCRIPTS
from gateway_harness import gateway_stack, random_adapter


def cli(capsys, tokenizer, script):
    """Runs `script(url, call)` next to a live gateway; `call(argv)` -> (exit code, stdout, stderr)."""
    async def go():
        async with gateway_stack(tokenizer) as st:
            def call(argv):
                code = main(argv + ["--url", st.address])
                out = capsys.readouterr()
                return code, out.out, out.err
            return await asyncio.to_thread(script, call), st
    return asyncio.run(go())


def text_of(tokenizer, task_id, n):
    return tokenizer.decode(tokenizer.encode(SCRIPTS[task_id], add_special_tokens=False)[:n],
                            skip_special_tokens=True)


def test_generate_first_with_lora_path_then_task_id_alone(capsys, tokenizer, tmp_path):
    w, c = random_adapter()
    write_npy_dir(adapter_from_tensors(w, c), tmp_path / "lora1")

    def script(call):
        return [
            call(["generate", "--text", "q", "--lora-path", str(tmp_path / "lora1"), "--lora-task-id", "1",
                  "--request-output-len", "9"]),
            call(["generate", "--text", "q", "--lora-task-id", "1", "-o", "9", "--streaming"]),
            call(["generate", "--text", "q", "--lora-task-id", "77"]),
            call(["generate", "--input-ids", "1,2,3", "-o", "4", "--json", "--top-k", "5", "--top-p", "0.5",
                  "--temperature", "0.7", "--random-seed", "3", "--stop", "zz"]),
        ]
    (first, streamed, missing, js), st = cli(capsys, tokenizer, script)
    want = text_of(tokenizer, 1, 9)
    assert first == (0, want + "\n", "")
    assert streamed == (0, want + "\n", "")
    assert missing[0] == 1 and "NOT_FOUND" in missing[2] and "task id 77" in missing[2]
    out = json.loads(js[1])
    assert js[0] == 0 and out["text"] == text_of(tokenizer, None, 4) and out["finish_reason"] == "length"
    sent = st.compute.log.requests[-1]
    assert list(sent.input_ids) == [1, 2, 3]
    assert (sent.sampling.top_k, sent.sampling.seed) == (5, 3)
    assert abs(sent.sampling.top_p - 0.5) < 1e-6 and abs(sent.sampling.temperature - 0.7) < 1e-6
    assert st.store.puts == 1


def test_generate_fan_out_prints_each_entry(capsys, tokenizer, tmp_path):
    w, c = random_adapter()
    write_llgtrt(adapter_from_tensors(w, c), tmp_path / "two.safetensors")

    def script(call):
        load = call(["load", "--local-path", str(tmp_path / "two.safetensors"), "--task-id", "2",
                     "--name", "jp"])
        fan = call(["generate", "--text", "q", "--fan-out", "base,jp,5", "-o", "6"])
        return load, fan
    (load, fan), _ = cli(capsys, tokenizer, script)
    assert load[0] == 0 and "task_id=2 name=jp" in load[1]
    code, out, err = fan
    assert code == 1  # entry 5 is not cached: its own error, the others print their text
    assert f"[0] base\n{text_of(tokenizer, None, 6)}\n" in out
    assert f"[1] name=jp\n{text_of(tokenizer, 2, 6)}\n" in out
    assert "NOT_FOUND" in err and "task id 5" in err


def test_load_list_unload_info(capsys, tokenizer, tmp_path):
    w, c = random_adapter(rank=8)
    write_npy_dir(adapter_from_tensors(w, c), tmp_path / "a")

    def script(call):
        return [call(["load", "--local-path", str(tmp_path / "a"), "--task-id", "4"]),
                call(["list"]), call(["list", "--json"]), call(["unload", "--task-id", "4"]),
                call(["unload", "--task-id", "4"]), call(["info"]), call(["load", "--local-path", str(tmp_path / "a")])]
    (load, listing, listing_json, unload, unload_again, info, no_id), _ = cli(capsys, tokenizer, script)
    assert load[0] == 0 and "task_id=4" in load[1] and "max_rank=8" in load[1]
    assert "task_id=4" in listing[1] and "1 adapter(s)" in listing[1]
    assert json.loads(listing_json[1])["adapters"][0]["task_id"] == "4"
    assert unload == (0, "unloaded task id 4\n", "")
    assert "nothing to unload" in unload_again[1]
    assert info[0] == 0 and "model_name: scripted" in info[1] and "max_model_len: 256" in info[1]
    assert no_id[0] == 2 and "--task-id" in no_id[2]


def test_gateway_down_is_one_line_and_exit_1(capsys, free_port):
    code = main(["list", "--url", f"127.0.0.1:{free_port}", "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("loraplex list: UNAVAILABLE") and err.count("\n") == 1


def test_dump_json_is_a_request_grpcurl_can_send(capsys, tmp_path):
    from google.protobuf.json_format import Parse

    from loraplex.tensor_proto import tensor_from_proto
    from loraplex.v1 import gateway_pb2
    w, c = random_adapter()
    write_npy_dir(adapter_from_tensors(w, c), tmp_path / "a")
    code = main(["generate", "--text", "首都", "--lora-path", str(tmp_path / "a"), "--lora-task-id", "3",
                 "-o", "5", "--stop", "\n", "--dump-json"])
    req = Parse(capsys.readouterr().out, gateway_pb2.GenerateRequest())
    assert code == 0 and req.text == "首都" and req.sampling.max_tokens == 5 and list(req.sampling.stop) == ["\n"]
    assert req.loras[0].task_id == 3
    assert (tensor_from_proto(req.loras[0].weights) == w).all()
    assert (tensor_from_proto(req.loras[0].config).numpy() == c).all()
