"""`layerstream generate` refuses bad arguments in one line with exit code 2, before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerstream import __version__
from layerstream.cli.main import main

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

MAX_SEED = 2**53 - 1
MAX_PROMPT_CHARS = 10_000  # the server's limit, stated here so a change to it is deliberate


@pytest.fixture
def run_cli(monkeypatch, tmp_path, capsys):
    """Run the command line in this process, with an empty model cache of its own: a check made "before any
    work" leaves that cache untouched, since loading even a tiny model first builds it there."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(cache))
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(name, "")  # main() sets these with setdefault: keep them from leaking out of the test
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, bool]:
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        lines = capsys.readouterr().err.splitlines()
        errors = [line for line in lines if line.startswith("layerstream: error:")]
        assert len(errors) <= 1, errors
        if not cache.exists():  # refused before loading: that line alone, no usage block, warning or traceback
            assert lines == errors, lines
        return code, errors[0] if errors else "", cache.exists()

    return run


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("a file, not a folder")
    return path


TOO_LONG = "x" * (MAX_PROMPT_CHARS + 1)

CASES = [
    (["--steps", "-3"], "layerstream: error: --steps: -3 is not allowed (an integer from 1 to 1000)"),
    (["--steps", "0"], "layerstream: error: --steps: 0 is not allowed (an integer from 1 to 1000)"),
    (["--steps", "many"], "layerstream: error: --steps: 'many' is not allowed (an integer from 1 to 1000)"),
    (["--fps", "0"], "--fps: 0 is not allowed (an integer from 1 to 120)"),
    (["--fps", "121"], "--fps: 121 is not allowed (an integer from 1 to 120)"),
    (["--nproc", "0"], "--nproc: 0 is not allowed (an integer >= 1)"),
    (["--link-gbps", "-1"], "--link-gbps: -1 is not allowed (a finite number > 0)"),
    (["tiny-flux", "--model", "tiny-wan"], "--model: the model is given twice ('tiny-flux' and 'tiny-wan'); give it once, as MODEL"),
    (["tiny-flux", "--num-frames", "9"], "--num-frames 9: tiny-flux makes images, not video"),  # MODEL first, as plan's
    (["--stepz", "3"], "unrecognized arguments: --stepz (see layerstream generate --help)"),  # 3: taken as MODEL
    (["--height", "100000", "--width", "100000"], "--height = 100000 is not valid; expected an integer from 1 to 2048 (the cap is set by --max-size)"),
    (["--width", "4096"], "--width = 4096 is not valid"),
    (["--num-frames", "1000"], "--num-frames = 1000 is not valid; expected an integer from 1 to 129 (the cap is set by --max-frames)"),
    (["--seed", "9007199254740992"], f"--seed: 9007199254740992 is not allowed (an integer from 0 to {MAX_SEED})"),
    (["--seed", "-1"], "--seed: -1 is not allowed"),
    (["--nproc", "2", "--seed", str(MAX_SEED)], f"--seed {MAX_SEED} is too large for 2 ranks"),
    (["--guidance-scale", "-1"], "--guidance-scale: -1 is not allowed (a number from 0 to 100)"),
    (["--guidance-scale", "101"], "--guidance-scale: 101 is not allowed (a number from 0 to 100)"),
    (["--guidance-scale", "nan"], "--guidance-scale: nan is not allowed"),
    (["--prompt", TOO_LONG], "--prompt: a text of 10,001 characters is not allowed (at most 10,000 characters, as the server takes)"),
    (["--negative-prompt", TOO_LONG], "--negative-prompt: a text of 10,001 characters is not allowed"),
    (["--output", "{file}/fox.gif"], "{file} is a file, not a folder"),
    (["--output", "{file}/deeper/fox.gif"], "{file} is a file, not a folder"),
    (["--output", "{tmp}/out.txt"], "--output {tmp}/out.txt: expected a .png, .mp4, .gif file"),
    (["--output", "{tmp}/fox.png"], "--output {tmp}/fox.png: tiny-wan makes a video; use a .mp4 or .gif file"),
    (["--model", "tiny-flux", "--output", "{tmp}/cat.gif"], "--output {tmp}/cat.gif: tiny-flux makes an image; use a .png file"),
    (["--model", "tiny-flux", "--num-frames", "5"], "--num-frames 5: tiny-flux makes images, not video; drop --num-frames"),
    (["--device", "nosuchdevice"], "--device 'nosuchdevice' is not a device"),
    # braces doubled: each case is formatted with {file} and {tmp}
    (["--extra-params", "{{bad"], "--extra-params: not valid JSON (Expecting property name enclosed in double quotes"),
    (["--extra-params", "[1]"], """--extra-params: '[1]' is not a JSON object; expected one such as '{{"sample_solver": "euler"}}'"""),
    (["--extra-params", '{{"num_inference_steps": 3}}'], "--extra-params num_inference_steps: 3 is not allowed (give --steps instead)"),
    (["--extra-params", '{{"generator": 3}}'], "--extra-params generator: 3 is not allowed (seed instead"),
    # nested a few thousand deep: was a RecursionError traceback and exit 1
    (["--extra-params", "{{" + '"a": ' + "[" * 3000 + "]" * 3000 + "}}"], "--extra-params: JSON text nests arrays and objects deeper than 32 levels"),
    (["--diffusion-offload-config", "[" * 3000 + "]" * 3000], "deeper than 32 levels, the limit"),
    (["--vae-use-tiling", "yes"], "--vae-use-tiling: 'yes' is not allowed (true, false or auto)"),
    (
        ["--vae-use-slicing", "true", "--diffusion-offload-config", '{{"mode": "layer", "components": ["dit"], "vae_use_slicing": false}}'],
        "--vae-use-slicing: diffusion_offload_config: vae_use_slicing = False is not valid; given otherwise (True)",
    ),
]


def _ids(case) -> str:
    return " ".join(a if len(a) < 40 else f"<{len(a)} characters>" for a in case[0])


@pytest.mark.parametrize("args, message", CASES, ids=[_ids(case) for case in CASES])
def test_refused_before_any_work(run_cli, tmp_path, args, message):
    fill = {"file": str(_file(tmp_path)), "tmp": str(tmp_path)}
    code, error, cache_used = run_cli("generate", *(a.format(**fill) for a in args))
    assert code == 2
    assert message.format(**fill) in error
    assert not cache_used, "a model was loaded before the arguments were checked"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_output_in_a_folder_that_refuses_files(run_cli):
    code, error, cache_used = run_cli("generate", "--output", "/proc/fox.gif")
    assert code == 2 and "--output /proc/fox.gif: cannot create files in /proc" in error and not cache_used


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_torch_without_cuda(run_cli, device):
    code, error, cache_used = run_cli("generate", "--device", device)
    assert code == 2 and f"--device '{device}': " in error and "--device cpu" in error and not cache_used


@pytest.mark.parametrize(
    "args, message",
    [
        (["--height", "2048", "--width", "2048"], "--height = 2048 is not valid; expected a multiple of 16 up to 1024 for tiny-wan"),
        (["--max-size", "4096", "--height", "4096", "--width", "4096"], "--height = 4096 is not valid; expected a multiple of 16 up to 1024"),
        (["--num-frames", "6"], "--num-frames = 6 is not valid; expected 4 * k + 1"),
        (["--extra-params", '{"sample_solver": "heun"}'], "--extra-params sample_solver: 'heun' is not valid for tiny-wan; expected one of 'unipc', 'euler', 'dpm++'"),
        (["--extra-params", '{"latents": null}'], "--extra-params latents: None is not valid for tiny-wan; expected one of the keys WanPipeline takes: attention_kwargs, max_sequence_length, sample_solver"),
    ],
)
def test_refused_by_what_the_model_can_make_before_the_first_step(run_cli, capsys, args, message):
    code, error, _ = run_cli("generate", "--steps", "1", *args)
    assert code == 2 and message in error
    assert not list(Path.cwd().glob("*.gif")) and not list(Path.cwd().glob("*.mp4"))


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"layerstream {__version__} (torch {torch.__version__}")


def test_help_states_the_seed_and_guidance_rules(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"rank r of --nproc uses seed + r (default: 0) (an integer from 0 to {MAX_SEED})" in text
    assert "(1 or less turns guidance off); default: the model's. (a number from 0 to 100)" in text


def test_the_prompt_limit_is_the_servers():
    """One number: the longest prompt the command line takes is the longest the server takes."""
    pydantic = pytest.importorskip("pydantic")
    from layerstream.cli.main import build_parser
    from layerstream.server.schemas import ImageGenerationRequest

    longest = "x" * MAX_PROMPT_CHARS
    assert build_parser().parse_args(["generate", "--prompt", longest]).prompt == longest
    ImageGenerationRequest(prompt=longest)
    with pytest.raises(pydantic.ValidationError):
        ImageGenerationRequest(prompt=longest + "x")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", longest + "x"])


@pytest.mark.parametrize("length, shown", [(80, "p" * 80), (81, "p" * 80 + "... (81 characters)"),
                                           (100_000, "p" * 80 + "... (100,000 characters)")])  # fmt: skip
def test_the_table_shortens_long_prompts(length, shown):
    from layerstream.cli.generate_summary import short_prompt

    assert short_prompt("p" * length) == shown
