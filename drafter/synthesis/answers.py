"""The target's answers to chat data: a whole regeneration run (`regenerate`), over a server or a local
target (`LocalBackend`: batched `model.generate`). The local backend loads the target and renders the
data's conversations; the rest of a regeneration is `regeneration.py` and `answer_server.py` beside it.
"""
import json
import threading
from pathlib import Path

from drafter.pipeline import chat, chat_files, chat_template
from drafter.synthesis.answer_server import ServerBackend, run_server
from drafter.pipeline.datasets import DataError
from drafter.synthesis.regeneration import (Recorder, RegenerateSettings, RowFailed, StopOnSignal, check_settings,
                                           completed_ids, load_jobs, report, run_local, side_file, summarize)


class LocalBackend:
    """Batched `model.generate` on a local HF target (left padding); greedy at temperature 0. A
    generate call ends at the next token once `stop` is set."""

    def __init__(self, settings: RegenerateSettings, stop: threading.Event):
        import torch
        from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList

        from drafter.target_model.model import load_target

        class UntilStopped(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((len(input_ids),), stop.is_set(), device=input_ids.device)

        self.tokenizer = AutoTokenizer.from_pretrained(settings.target, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_target(settings.target, settings.device, getattr(torch, settings.dtype))
        self.enable_thinking, self.max_tokens = settings.thinking, settings.max_tokens
        self.sampling = {"do_sample": True, "temperature": settings.temperature} \
            if settings.temperature > 0 else {"do_sample": False}
        self.eos_ids = sorted({self.tokenizer.eos_token_id} | set(self._config_eos_ids()))
        self.until_stopped = StoppingCriteriaList([UntilStopped()])
        torch.manual_seed(settings.seed)

    def _config_eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def prompt(self, history: list[dict]) -> str:
        try:
            return chat_template.render(self.tokenizer, history, self.enable_thinking, add_generation_prompt=True)
        except chat.BadRow as bad:
            raise RowFailed(bad.reason, str(bad)) from bad

    def generate(self, prompts: list[str]) -> list[tuple[str, bool]]:
        """(answer, truncated) per prompt."""
        import torch

        batch = self.tokenizer(prompts, add_special_tokens=False, padding=True,
                               return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            output = self.model.generate(**batch, max_new_tokens=self.max_tokens,
                                         eos_token_id=self.eos_ids,
                                         pad_token_id=self.tokenizer.pad_token_id,
                                         stopping_criteria=self.until_stopped, **self.sampling)
        new_tokens = output[:, batch["input_ids"].shape[1]:]
        stopped = torch.isin(new_tokens, torch.tensor(self.eos_ids, device=new_tokens.device)).any(1)
        texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return [(text, not bool(ended)) for text, ended in zip(texts, stopped)]


def regenerate(settings: RegenerateSettings) -> dict:
    """Rewrite the conversations of `settings.input` into `settings.out` (resuming after the ids it
    already holds), write OUT.summary.json and return it. A first signal winds the run down (the
    summary says `interrupted`); input or an output that cannot be resumed raises DataError."""
    out = Path(settings.out)
    try:
        jobs = load_jobs(settings.input, settings.system_prompt, exclude=(str(out),))
    except chat_files.InputError as error:
        raise DataError(f"stopped, nothing written: {error}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(out)  # first: an --out that is not an output is refused before a side file is written
    check_settings(out, settings.recorded())
    todo = [job for job in jobs.todo if job.id not in done]
    this_run = todo[: settings.max_rows] if settings.max_rows is not None else todo
    recorder = Recorder(out, len(this_run))
    try:
        with StopOnSignal() as stop:
            if settings.backend == "server":
                run_server(ServerBackend(settings, stop), this_run, recorder, settings.concurrency, stop)
            else:
                run_local(LocalBackend(settings, stop), this_run, recorder, settings.batch_size, stop)
    finally:
        recorder.close()
    summary = summarize(jobs, todo, recorder, stop.is_set(), settings.input)
    side_file(out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report(summary, jobs)
    return summary
