"""`hmactl chat`: a conversation with hmad, its answers streamed as they come.

Each message is sent with the whole conversation so far (the daemon keeps nothing between requests; its
prefix cache reuses the KV of the turns it has seen). Two ways to send it, chosen by ``hmactl`` (cli.py):

- **chat template** (a model that has one, or ``--chat-template``): the turns as ``messages``, the daemon
  renders them;
- **plain text** (a base model, one without a chat template, or ``--raw``): the conversation as a transcript
  the model continues, with ``stop`` at the next ``"\\nUser:"``::

      SYSTEM TEXT            (when /system gave one, then a blank line)
      User: first message
      Assistant: first answer
      User: this message
      Assistant:

Input, a message or a command per line; a line ending in a backslash goes on on the next line (llama.cpp's
way), and a block opened by a line starting with ``\"\"\"`` runs until a line ending with ``\"\"\"``
(Ollama's); a message that starts with "/" is written "//...". In a terminal, Alt-Enter also starts a new
line, and lines are edited and recalled with prompt_toolkit (history in
``$XDG_STATE_HOME/hmad/chat_history``, else ``~/.local/state/hmad/...``). When stdin or stdout is not a
terminal the same lines are read from stdin without prompts, so a conversation can be scripted
(``printf 'Hi\\nAnd then?\\n' | hmactl chat``): one turn a line, the answers on stdout.

Commands: ``/system TEXT`` (the system prompt; ``/system`` alone removes it), ``/clear`` (forget the turns,
keep the system prompt), ``/image PATH`` (an image for the next message; chat template only), ``/save FILE``
(the conversation as JSON: ``{"model", "chat_template", "messages"}``, the messages in hmaclient's form,
images as their paths), ``/help`` (``/?``), ``/bye``.

Ctrl-C while an answer streams cancels its request on the daemon and drops that exchange, the message (with
its images) and the partial answer, so the conversation is as it was before it; Ctrl-C at the prompt clears
the line; Ctrl-D (end of input) leaves. Without a terminal, SIGINT while reading input leaves with 130.

A failed message (an error reply, a timeout) is reported on stderr and dropped, with the images it carried;
the session goes on. Without a terminal, the exit status is then 1 at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hmaclient import protocol as P
from hmaclient.client import Client, image_bytes
from hmaclient.errors import HmaError, RequestError

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'
USER, ASSISTANT = "User:", "Assistant:"  # the plain-text transcript's speakers
RAW_STOP = "\n" + USER  # where a base model's answer ends: it starts the user's next line

HELP = """\
  /system TEXT   set the system prompt (/system alone removes it)
  /clear         forget the conversation (the system prompt stays)
  /image PATH    send an image with the next message
  /save FILE     write the conversation to FILE as JSON
  /help, /?      this list
  /bye           leave (Ctrl-D too)
A line ending in \\ goes on on the next line; \"\"\" opens and closes a block of lines; Alt-Enter
starts a new line. Ctrl-C cancels an answer, or clears the line."""

Lines = Callable[[str], str]  # prompt -> one line of input (no newline); EOFError at the end


@dataclass
class Conversation:
    """The turns so far and the images waiting for the next message. ``messages`` hold the user and
    assistant turns in hmaclient's form (content a str, or parts with images as paths); ``raw``: sent as a
    plain-text transcript instead of through the chat template."""

    raw: bool
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)

    def user_turn(self, text: str) -> dict[str, Any]:
        """The next user message: the waiting images first, then the text."""
        if not self.images:
            return {"role": "user", "content": text}
        parts = [{"type": "image", "image": path} for path in self.images]
        return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

    def wire(self, turn: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The messages as sent: the system prompt first, the turns, and ``turn`` (the new message)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages + ([turn] if turn else [])

    def transcript(self, text: str) -> str:
        """The plain-text prompt of a raw conversation that ends with the user's ``text``."""
        lines = [f"{USER if m['role'] == 'user' else ASSISTANT} {m['content']}" for m in self.messages]
        head = f"{self.system}\n\n" if self.system else ""
        return head + "\n".join([*lines, f"{USER} {text}", ASSISTANT])

    def request(self, text: str, params: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of ``Client.stream`` for the message ``text``."""
        if not self.raw:
            return {"messages": self.wire(self.user_turn(text)), **params}
        stop = [*(params.get("stop") or ()), RAW_STOP]
        return {"prompt": self.transcript(text), **params, "raw": True, "stop": stop}


@dataclass
class Chat:
    """One session: the conversation, the client it talks through and where it writes."""

    client: Client
    conversation: Conversation
    params: dict[str, Any]  # sampling fields for every message
    model: str  # the model's name, for /save
    out: TextIO
    err: TextIO
    interactive: bool
    failed: bool = False

    def run(self, lines: Lines) -> int:
        """Read and answer until the end of input or /bye; the exit status."""
        while True:
            try:
                text = read_turn(lines)
            except EOFError:
                break
            except KeyboardInterrupt:
                if self.interactive:
                    continue  # Ctrl-C at the prompt: the line is gone, ask again
                return EXIT_INTERRUPTED
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if not self.command(text):
                    break
                continue
            self.ask(text.removeprefix("/"))  # "//x" sends "/x"
        return EXIT_FAILED if self.failed and not self.interactive else EXIT_OK

    def ask(self, text: str) -> None:
        """Send ``text`` with the conversation, stream the answer, and keep the exchange when it ended (not
        when it was cancelled or failed)."""
        turn = self.conversation.user_turn(text)
        try:
            answer, reason = self._stream(self.conversation.request(text, self.params))
        except KeyboardInterrupt:
            self._note("cancelled: the message and its partial answer are not kept")
            return
        except (HmaError, P.ProtocolError) as e:
            self._failed(e)
            return
        finally:
            self.conversation.images = []  # sent with this message, or dropped with it
        self.conversation.messages += [turn, {"role": "assistant", "content": answer}]
        if reason == "length":
            self._note(f"the answer stopped at max_tokens ({self.params.get('max_tokens', 'the default')})")

    def _stream(self, request: dict[str, Any]) -> tuple[str, str]:
        """Stream one answer to ``out``; (its text, its finish reason). Leaving on KeyboardInterrupt (or
        any error) closes the stream, which cancels the request on the daemon."""
        pieces = self.client.stream(**request)
        shown: list[str] = []
        with contextlib.closing(pieces):
            try:
                while True:
                    piece = next(pieces)
                    text = piece.text
                    if self.conversation.raw and not shown:
                        text = text.lstrip()  # after "Assistant:" the answer starts with a space
                    if text:
                        shown.append(text)
                        self.out.write(text)
                        self.out.flush()
            except StopIteration as end:
                result = end.value
            finally:
                self._end_line(shown)
        return "".join(shown), result.finish_reason if result is not None else "cancelled"

    def _end_line(self, shown: list[str]) -> None:
        with contextlib.suppress(KeyboardInterrupt):
            if shown and not shown[-1].endswith("\n"):
                self.out.write("\n")
            if self.interactive:
                self.out.write("\n")  # a blank line between an answer and the next prompt
            self.out.flush()

    def command(self, line: str) -> bool:
        """Run one /command; False to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/bye":
            return False
        if name in ("/help", "/?"):
            print(HELP, file=self.err if not self.interactive else self.out)
        elif name == "/system":
            self.conversation.system = arg or None
            self._note("system prompt set" if arg else "system prompt removed")
        elif name == "/clear":
            self.conversation.messages, self.conversation.images = [], []
            self._note("conversation cleared")
        elif name == "/image":
            self._image(arg)
        elif name == "/save":
            self._save(arg)
        else:
            self._note(f"unknown command {name}: /help lists them")
        return True

    def _image(self, path: str) -> None:
        if not path:
            self._note("/image needs a file: /image PATH")
        elif self.conversation.raw:
            self._note(
                "images need the chat template; this model is prompted raw (hmactl chat --chat-template)"
            )
        else:
            try:
                image_bytes(os.path.expanduser(path), "image")  # its checks now, not at the next message
            except P.ProtocolError as e:
                self._note(e.message)
                return
            self.conversation.images.append(os.path.abspath(os.path.expanduser(path)))
            self._note(f"{path} goes with your next message")

    def _save(self, path: str) -> None:
        if not path:
            self._note("/save needs a file: /save FILE")
            return
        saved = {
            "model": self.model,
            "chat_template": not self.conversation.raw,
            "messages": self.conversation.wire(),
        }
        try:
            Path(path).expanduser().write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            self._note(f"cannot write {path}: {e.strerror}")
            return
        self._note(f"saved {len(saved['messages'])} messages to {path}")

    def _failed(self, e: BaseException) -> None:
        self.failed = True
        if isinstance(e, RequestError):
            hint = " (/clear starts over)" if e.code == P.PROMPT_TOO_LONG else ""
            self._note(f"error: {e.code}: {e.message}{hint}")
        elif isinstance(e, P.ProtocolError):
            self._note(f"error: {e.message}")
        else:
            self._note(f"error: {e}")

    def _note(self, text: str) -> None:
        print(f"hmactl: {text}", file=self.err, flush=True)


def read_turn(lines: Lines) -> str:
    """One message or command: a line; lines joined while one ends in a backslash; or a block from a line
    starting with three double quotes to one ending with them. End of input inside a continuation ends the
    turn there (the next read raises EOFError)."""
    line = lines(PROMPT)
    if line.lstrip().startswith(BLOCK):
        return _block(line.lstrip()[len(BLOCK) :], lines)
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        try:
            line = lines(MORE)
        except EOFError:
            return "\n".join(parts)
    return "\n".join([*parts, line])


def _block(first: str, lines: Lines) -> str:
    parts, line = [], first
    while not line.rstrip().endswith(BLOCK):
        parts.append(line)
        try:
            line = lines(MORE)
        except EOFError:
            return "\n".join(parts).strip("\n")
    parts.append(line.rstrip()[: -len(BLOCK)])
    return "\n".join(parts).strip("\n")


def pipe_lines(stream: TextIO) -> Lines:
    """Lines from a stream that is not a terminal: no prompts; EOFError at its end."""

    def read(_prompt: str) -> str:
        line = stream.readline()
        if not line:
            raise EOFError
        return line.removesuffix("\n").removesuffix("\r")

    return read


def history_path(env: dict[str, str] | os._Environ = os.environ) -> Path:
    """Where the terminal's input history is kept: $XDG_STATE_HOME/hmad/chat_history, else
    ~/.local/state/hmad/chat_history."""
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "hmad" / "chat_history"


def terminal_session(history: Path | None = None, **io: Any) -> Any:
    """A prompt_toolkit PromptSession with the history file (in memory when it cannot be made) and
    Alt-Enter for a new line; ``io``: its input and output (a test's pipe input)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    kept: Any = InMemoryHistory()
    if history is not None:
        with contextlib.suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            kept = FileHistory(str(history))
    return PromptSession(
        history=kept,
        key_bindings=keys,
        placeholder="Send a message (/? for help)",
        prompt_continuation=MORE,
        **io,
    )


def session_lines(session: Any) -> Lines:
    """Lines from a prompt_toolkit session: Ctrl-C raises KeyboardInterrupt, Ctrl-D EOFError."""
    return lambda prompt: session.prompt(prompt)
