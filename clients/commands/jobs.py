"""`streamvox submit`, `streamvox jobs`, `streamvox fetch ID`: REST jobs on a running server."""

from __future__ import annotations

import argparse
import json
import sys

from .say import CommandError, add_connection_arguments, call_server


def register(subparsers) -> None:
    submit = subparsers.add_parser("submit", help="submit a synthesis job (REST)")
    submit.add_argument("text", help="text to synthesize ('-' reads stdin)")
    submit.add_argument("--format", dest="response_format", choices=("wav", "flac"), default="wav")
    submit.add_argument("--voice", default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--speed", type=float, default=None)
    submit.add_argument("--wait", action="store_true",
                        help="poll until the job is finished, with a progress bar on stderr (exit 1 unless it "
                             "succeeded)")
    submit.add_argument("-q", "--quiet", action="store_true",
                        help="print only the job id, no progress bar (JOB_ID=$(streamvox submit -q ...))")
    add_connection_arguments(submit)
    submit.set_defaults(func=run_submit)

    jobs = subparsers.add_parser("jobs", help="list jobs, or show one")
    jobs.add_argument("id", nargs="?", help="a job id (omit to list)")
    jobs.add_argument("--status", choices=("queued", "running", "succeeded", "failed", "cancelled"))
    add_connection_arguments(jobs)
    jobs.set_defaults(func=run_jobs)

    fetch = subparsers.add_parser("fetch", help="download a finished job's audio")
    fetch.add_argument("id", help="job id")
    fetch.add_argument("--out", default=None, help="output file (default ID.wav / ID.flac)")
    add_connection_arguments(fetch)
    fetch.set_defaults(func=run_fetch)


def _call(args: argparse.Namespace, action) -> int:
    return call_server(args, action)[0]


def _left(seconds: float | None) -> str:
    if seconds is None:
        return ""
    minutes, secs = divmod(round(seconds), 60)
    return f", {minutes} min {secs:02d} s left" if minutes else f", {secs} s left"


class ProgressBar:
    """``submit --wait``'s progress on stderr (tqdm): the job's percent done, its utterances, the
    audio made so far and the server's estimate of the time left, one update per poll."""

    def __init__(self, job_id: str, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=100.0, desc=f"job {job_id[:8]}", file=sys.stderr, disable=not enabled,
                        bar_format="{desc}: {percentage:5.1f}%|{bar}|{postfix}", dynamic_ncols=True)

    def __call__(self, job: dict) -> None:
        progress = job["progress"]
        self.bar.n = min(100.0, progress["percent"])
        self.bar.set_postfix_str(f"{job['status']}, {progress['utterances_done']}/{progress['utterances_total']} "
                                 f"utterances, {progress['audio_seconds']:.1f} s of audio"
                                 f"{_left(progress['seconds_left']) if job['status'] == 'running' else ''}",
                                 refresh=True)

    def close(self) -> None:
        self.bar.close()


def run_submit(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    params = {k: v for k, v in {"voice": args.voice, "seed": args.seed, "speed": args.speed}.items() if v is not None}

    async def action(client):
        job = await client.submit_job(text, response_format=args.response_format, **params)
        if args.wait:
            bar = ProgressBar(job["id"], enabled=not args.quiet)
            try:
                job = await client.wait_job(job["id"], on_progress=bar)
            finally:
                bar.close()
        print(job["id"] if args.quiet else json.dumps(job, indent=2))
        if args.wait and job["status"] != "succeeded":  # a script's `&& fetch` must not run on a failed job
            error = job.get("error") or {}
            raise CommandError(f"job {job['id']} {job['status']}" + (f": {error}" if error else ""))

    return _call(args, action)


def run_jobs(args: argparse.Namespace) -> int:
    async def action(client):
        if args.id:
            print(json.dumps(await client.get_job(args.id), indent=2))
            return
        for job in await client.list_jobs(args.status):
            progress = job["progress"]
            print(f"{job['id']}  {job['status']:<9}  {progress['percent']:5.1f}%  "
                  f"{progress['utterances_done']}/{progress['utterances_total']} utterances  "
                  f"{progress['frames_done']}/{progress['frames_total']} frames")

    return _call(args, action)


def run_fetch(args: argparse.Namespace) -> int:
    from clients.commands.output_file import OutputError, audio_file, write_audio_bytes

    async def action(client):
        job = await client.get_job(args.id)
        out = args.out or f"{args.id}.{job.get('response_format', 'wav')}"
        try:  # a file problem is the command's, not the network's
            target = audio_file(out)
            data = await client.fetch_audio(args.id)
            write_audio_bytes(target, data)  # in --out's format
        except OutputError as exc:
            raise CommandError(str(exc), code=2) from None
        print(f"wrote {out} ({len(data)} bytes)")

    return _call(args, action)
