"""``run_batch``: an OpenAI Batch input file through the engine, results appended as they finish.

The input is read line by line while at most ``max_in_flight`` engine requests (samples) are
outstanding; each finished line is written whole to the results file at once.  Lines the
results file already holds (by ``custom_id``) are skipped, so a stopped run is resumed by
running the same command again.  See ``docs/run-batch.md``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_core.batch.id_set import IdSet
from deepinfer_core.batch.results_file import DUPLICATE_CODE, Finished, ResultWriter, read_finished
from deepinfer_core.batch.summary import BatchSummary
from deepinfer_core.errors import ConfigError, DeepInferError
from deepinfer_core.llm import LLM
from deepinfer_core.logging_utils import configure_logging
from deepinfer_core.openai import OpenAIError, ParsedRequest, error_object, parse_request, response_body
from deepinfer_core.openai.token_texts import TokenTexts
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.user_files import check_writable

logger = logging.getLogger("deepinfer.batch")

IN_FLIGHT_PER_SEQ = 4
"""Default ``max_in_flight`` is this many times the engine's ``max_num_seqs``."""


@dataclass
class _Line:
    """One input line being answered."""

    number: int
    custom_id: str
    req: ParsedRequest
    slot: int  # output order (``ordered``)
    outputs: list[RequestOutput] = field(default_factory=list)  # one per prompt
    left: int = 0  # samples not finished
    error: str | None = None


def run_batch(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    llm: LLM | None = None,
    max_in_flight: int | None = None,
    ordered: bool = False,
    fsync: bool = False,
    progress: bool = True,
    **engine_kwargs: Any,
) -> BatchSummary:
    """Answer every request of an OpenAI Batch input file into a results file.

    Args:
        input_path: JSONL, one ``{"custom_id", "method": "POST", "url", "body"}`` per line.
        output_path: the results file (created, or resumed: the ``custom_id``s it holds are
            skipped and a torn last line is cut away).
        llm: the engine to use; default ``LLM(**engine_kwargs)``.
        max_in_flight: most engine requests (samples) outstanding; default
            :data:`IN_FLIGHT_PER_SEQ` x ``max_num_seqs``.
        ordered: write the results in input order (finished lines wait, within
            ``max_in_flight``, for the lines before them) instead of completion order.
        fsync: ``fsync`` the results file after every line.
        progress: a progress bar on stderr.

    Returns:
        The run's :class:`BatchSummary` (:attr:`BatchSummary.exit_status`: 0 when no line failed).

    Raises:
        ConfigError: unreadable input, unwritable output, a results file that is not one, a bad
            ``max_in_flight``.
    """
    _check_paths(input_path, output_path)
    if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
        raise ConfigError(f"run-batch --max-in-flight={max_in_flight!r}: must be an int >= 1")
    configure_logging()
    finished = read_finished(output_path)
    if llm is None:
        llm = LLM(**engine_kwargs)
    limit = max_in_flight or IN_FLIGHT_PER_SEQ * llm.config.max_num_seqs
    writer = ResultWriter(output_path, fsync=fsync)
    try:
        return _Run(llm, finished, writer, limit, ordered, progress).run(input_path)
    finally:
        writer.close()


def _check_paths(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str]) -> None:
    src, dst = Path(input_path), Path(output_path)
    if not src.is_file():
        why = "is a directory" if src.is_dir() else "does not exist"
        raise ConfigError(f"run-batch -i {input_path}: {why}; give the batch input file (.jsonl)")
    if not os.access(src, os.R_OK):
        raise ConfigError(f"run-batch -i {input_path}: not readable")
    check_writable(output_path, "run-batch -o")
    if dst.exists() and src.resolve() == dst.resolve():
        raise ConfigError(f"run-batch: -i and -o name the same file {input_path}")


class _Run:
    """The state of one run: input cursor, lines in the engine, the output order."""

    def __init__(
        self, llm: LLM, finished: Finished, writer: ResultWriter, limit: int, ordered: bool, progress: bool
    ):
        self.engine = llm.client  # the engine of this process, or the distributed run's coordinator
        self.tokenizer = llm.get_tokenizer()
        self.model = str(llm.config.model) if llm.config.model else "deepinfer-tiny"
        self.finished = finished
        self.writer = writer
        self.limit = limit
        self.ordered = ordered
        self.progress = progress
        self.summary = BatchSummary()
        self.seen = IdSet()  # custom ids of this input so far
        self.samples: dict[str, tuple[_Line, int, int]] = {}  # engine id -> line, prompt, sample
        self.outstanding = 0  # samples admitted and not written (lines without samples count 1)
        self.next_slot = 0
        self.next_write = 0
        self.held: dict[int, tuple[str, int]] = {}  # ordered: slot -> (line, its outstanding count)
        self._token_text = TokenTexts(self.tokenizer)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, input_path: str | os.PathLike[str]) -> BatchSummary:
        t0 = time.perf_counter()
        bar = _bar(input_path) if self.progress else None
        self.bar = bar
        try:
            lines = _read_lines(input_path)
            exhausted = False
            while True:
                while not exhausted and (self.outstanding < self.limit or not self.samples):
                    item = next(lines, None)
                    if item is None:
                        exhausted = True
                    else:
                        self._admit(*item)
                if not self.engine.has_unfinished():
                    if exhausted:
                        break
                    continue
                for out in self.engine.step():
                    self._collect(out)
        except BaseException as e:  # leave a caller's engine clean (the lines written stay)
            self.engine.abort_all(f"run_batch was interrupted: {type(e).__name__}: {e}")
            raise
        finally:
            if bar is not None:
                bar.close()
        self.summary.seconds = time.perf_counter() - t0
        return self.summary

    def _tick(self, failed: bool = False) -> None:
        if self.bar is not None:
            if failed:
                self.bar.set_postfix_str(f"failed {self.summary.failed}", refresh=False)
            self.bar.update(1)

    # ---- admission -----------------------------------------------------------------------------
    def _admit(self, number: int, raw: bytes) -> None:
        """Read one input line: skip it, answer it with an error, or add its requests."""
        if not raw.strip():
            self._tick()
            return
        self.summary.lines += 1
        try:
            record = json.loads(raw)
        except ValueError as e:
            self._unnamed(number, "invalid_json", f"line {number}: not valid JSON ({e})")
            return
        if not isinstance(record, dict):
            self._unnamed(
                number, "invalid_line", f"line {number}: must be a JSON object, got {type(record).__name__}"
            )
            return
        cid = record.get("custom_id")
        if not isinstance(cid, str) or not cid:
            self._unnamed(
                number, "missing_custom_id", f'line {number}: "custom_id" must be a non-empty string'
            )
            return
        if cid in self.seen:
            if self.finished.duplicates[cid] > 0:
                self.finished.duplicates[cid] -= 1
                self._skip(failed=True)
            else:
                message = (
                    f"line {number}: custom_id {cid!r} is used by an earlier line; custom ids must be unique"
                )
                self._fail(number, cid, OpenAIError(message, DUPLICATE_CODE, "custom_id"), envelope=True)
            return
        self.seen.add(cid)
        if cid in self.finished.succeeded or cid in self.finished.failed:
            self._skip(failed=cid in self.finished.failed)
            return
        try:
            req = _parse_envelope(record, number)
            line = _Line(number, cid, req, slot=-1)
            prompts = self._prompts(req)
            params = [req.sampling_params(len(ids), self.engine.config.max_model_len) for _, ids in prompts]
            for p in params:
                self.engine.check_params(p)
        except OpenAIError as e:
            self._fail(number, cid, e, envelope=e.code in ("invalid_url", "invalid_method", "missing_body"))
            return
        except DeepInferError as e:  # the engine's checks (vocabulary, tokenizer) and the chat template
            self._fail(number, cid, OpenAIError(str(e), "invalid_parameter"), envelope=False)
            return
        line.slot = self._take_slot()
        line.left = len(prompts) * req.n
        self.outstanding += line.left
        for p, ((text, ids), sp) in enumerate(zip(prompts, params, strict=True)):
            line.outputs.append(RequestOutput(str(p), text, list(ids), outputs=[None] * req.n))  # type: ignore[list-item]
            for k in range(req.n):
                engine_id = f"{number}/{p}/{k}"
                self.samples[engine_id] = (line, p, k)
                self.engine.add_request(engine_id, ids, sp, prompt=text, sample_index=k)
                self.summary.engine_requests += 1

    def _prompts(self, req: ParsedRequest) -> list[tuple[str | None, list[int]]]:
        """Each prompt's text and token ids (a chat request: its conversation rendered as
        :meth:`LLM.chat` renders it)."""
        if req.kind == "chat":
            if self.tokenizer is None:
                raise OpenAIError(
                    "chat completions need a tokenizer with a chat template; the model has none"
                )
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
            return [(text, self.tokenizer.encode(text, add_bos=False))]
        return [(p, self.engine.encode(p)) if isinstance(p, str) else (None, p) for p in req.prompts]

    def _take_slot(self) -> int:
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        return slot

    # ---- results -------------------------------------------------------------------------------
    def _collect(self, out: RequestOutput) -> None:
        """File one finished sample; write its line when it was the line's last."""
        line, p, k = self.samples.pop(out.request_id)
        comp = out.outputs[0]
        comp.index = k
        line.outputs[p].outputs[k] = comp
        if out.error and line.error is None:
            line.error = _strip_request_id(out.error, out.request_id)
        self.summary.generated_tokens += len(comp.token_ids)
        line.left -= 1
        if line.left:
            return
        samples = len(line.outputs) * line.req.n
        if line.error is not None:
            self._finish(
                line.slot,
                samples,
                _record(
                    line.number, line.custom_id, OpenAIError(line.error, "request_failed"), envelope=False
                ),
                failed=True,
            )
            return
        body = response_body(
            line.req,
            line.outputs,
            response_id=f"{'chatcmpl' if line.req.kind == 'chat' else 'cmpl'}-{line.number}",
            created=int(time.time()),
            model=self.model,
            token_text=self._token_text,
        )
        response = {"status_code": 200, "request_id": f"req_{line.number}", "body": body}
        record = {
            "id": f"batch_req_{line.number}",
            "custom_id": line.custom_id,
            "response": response,
            "error": None,
        }
        self._finish(line.slot, samples, _dumps(record), failed=False)

    def _unnamed(self, number: int, code: str, message: str) -> None:
        """An error line for an input line without a usable custom id (skipped when resuming:
        such lines are answered in input order, so the first ``unnamed`` of them are done)."""
        if self.finished.unnamed > 0:
            self.finished.unnamed -= 1
            self._skip(failed=True)
            return
        self._fail(number, None, OpenAIError(message, code), envelope=True)

    def _skip(self, failed: bool) -> None:
        self.summary.skipped += 1
        self.summary.skipped_failed += failed
        self._tick()

    def _fail(self, number: int, cid: str | None, error: OpenAIError, envelope: bool) -> None:
        self._finish(self._take_slot(), 0, _record(number, cid, error, envelope), failed=True)

    def _finish(self, slot: int, samples: int, text: str, failed: bool) -> None:
        """Count a line's outcome and write it (``ordered``: once every earlier line is written)."""
        if failed:
            self.summary.failed += 1
            if self.summary.first_error is None:
                self.summary.first_error = json.loads(text)["error"]["message"]
        else:
            self.summary.completed += 1
        self._tick(failed)
        if not self.ordered:
            self.outstanding -= samples
            self.writer.write(text)
            return
        cost = samples or 1  # an answered line waiting for its turn takes room too
        self.outstanding += cost - samples
        self.held[slot] = (text, cost)
        while self.next_write in self.held:
            text, cost = self.held.pop(self.next_write)
            self.writer.write(text)
            self.outstanding -= cost
            self.next_write += 1


def _parse_envelope(record: dict[str, Any], number: int) -> ParsedRequest:
    """The request of a line's ``method`` / ``url`` / ``body``."""
    method = record.get("method", "POST")
    if method != "POST":
        raise OpenAIError(
            f'line {number}: method {method!r} is not supported; use "POST"', "invalid_method", "method"
        )
    if "body" not in record:
        raise OpenAIError(f'line {number}: "body" is missing', "missing_body", "body")
    url = record.get("url")
    if not isinstance(url, str):
        raise OpenAIError(f'line {number}: "url" must be a string, got {url!r}', "invalid_url", "url")
    return parse_request(url, record["body"])


def _record(number: int, cid: str | None, error: OpenAIError, envelope: bool) -> str:
    """An error line: ``response`` is ``null`` when the line is not a request (bad JSON,
    custom id, method, url), else the 400 response with the OpenAI error body."""
    response = None
    if not envelope:
        response = {
            "status_code": error.status,
            "request_id": f"req_{number}",
            "body": {"error": error_object(error)},
        }
    record = {
        "id": f"batch_req_{number}",
        "custom_id": cid,
        "response": response,
        "error": {"code": error.code, "message": error.message},
    }
    return _dumps(record)


def _strip_request_id(message: str, request_id: str) -> str:
    """An engine message without its ``request '<id>': `` prefix (the id is internal)."""
    prefix = f"request {request_id!r}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _dumps(record: dict[str, Any]) -> str:
    """One compact JSON line, UTF-8 as it is; escaped to ASCII when it holds a lone surrogate
    (an input ``\\ud800`` echoed back), which UTF-8 cannot encode."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(record, separators=(",", ":"), allow_nan=False)
    return text


def _read_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each input line, read as a stream."""
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


def _bar(path: str | os.PathLike[str]) -> Any:
    """A tqdm bar over the input's lines (counted by a quick pass over the bytes)."""
    from tqdm import tqdm

    count = 0
    last = b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    count += last != b"\n"
    return tqdm(total=count, desc="run-batch", unit="line", dynamic_ncols=True)
