"""`llmc run`: completions from an engine file (llmc.LLM)."""

import json
import sys

import click

from llmc.cli.common import main, prompts_from, share_threads, speculative_tokens_option
from llmc.errors import LlmcError


@main.command()
@click.argument("engine", type=click.Path(dir_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="A prompt; repeat for several.")
@click.option("--prompts-file", type=click.Path(dir_okay=False),
              help="Prompts, one per line, or JSONL objects with a 'prompt' field.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--min-p", default=0.0, show_default=True, type=float, help="0 disables.")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float, help="1 disables.")
@click.option("--presence-penalty", default=0.0, show_default=True, type=float, help="0 disables.")
@click.option("--seed", type=int, help="Seed for sampling (per request).")
@click.option("--stream", is_flag=True, help="Print tokens as they are generated.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per completion.")
@speculative_tokens_option
def run(engine, prompts, prompts_file, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, seed, stream, as_json, speculative_tokens):
    """Generate completions with an ENGINE file."""
    from llmc.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty, seed=seed)
    prompts = prompts_from(prompts, prompts_file)
    if not prompts:
        raise LlmcError("--prompt: give at least one prompt (or --prompts-file)")
    share_threads(None)
    llm = LLM(engine, speculative_tokens=speculative_tokens)
    for index, prompt in enumerate(prompts):
        llm.encode(prompt, index)  # reject a bad prompt before generating for any
    if stream:
        for prompt in prompts:
            _stream_one(llm, prompt, params, as_json)
        llm.section_check.wait()  # the weights' checksum, hashed while generating
        return
    completions = llm.generate(prompts, params)
    llm.section_check.wait()  # the weights' checksum, hashed while generating: before any output
    for completion in completions:
        if as_json:
            click.echo(json.dumps({"prompt": completion.prompt, "text": completion.text,
                                   "token_ids": completion.token_ids,
                                   "prompt_token_ids": completion.prompt_token_ids,
                                   "finish_reason": completion.finish_reason}))
        else:
            click.echo(completion.prompt + completion.text)


def _stream_one(llm, prompt: str, params, as_json: bool) -> None:
    if not as_json:
        click.echo(prompt, nl=False)
    for chunk in llm.stream(prompt, params):
        if as_json:
            click.echo(json.dumps({"prompt": prompt, "token_id": chunk.token_id, "text": chunk.text,
                                   "finish_reason": chunk.finish_reason}))
        else:
            click.echo(chunk.text, nl=False)
            sys.stdout.flush()
    if not as_json:
        click.echo()
