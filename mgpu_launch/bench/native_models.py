"""The native rows' models: every mgpu-bench model written in plain torch (no Keras).

Same shapes as the Keras models of ``models.py``; what a torch user writes by hand:

- ``resnet50`` / ``inceptionv3``: torchvision's (needs ``torchvision``), no auxiliary head;
- ``cifar-cnn``, ``mlp``, ``mlp-tiny``: the same layers as the Keras ``Sequential`` (logits out,
  the softmax in the loss);
- GPT-2 (:class:`GPT`): token and learned position embeddings, pre-LayerNorm blocks of causal
  self-attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels
  on GPUs) and a GELU (tanh) feed-forward, a final LayerNorm, the output tied to the token
  embedding; dropout 0.1 as keras-hub's;
- BERT (:class:`Bert`): token, position and segment embeddings with a LayerNorm, post-LayerNorm
  encoder blocks (attention through ``F.scaled_dot_product_attention``, GELU feed-forward), a
  tanh pooler on the first token and a linear classifier; dropout 0.1.

No padding mask: the synthetic sequences have none (keras-hub's models get an all-ones mask).

:func:`build` returns ``(model, make_batch)``: ``make_batch(batch, device)`` gives one random
(inputs, labels) batch on the device, and the loss is ``F.cross_entropy`` of the model's
output (per token for GPT-2).
"""

import torch
import torch.nn.functional as F
from torch import nn

from mgpu_launch.bench.models import MODELS, Transformer


class _Attention(nn.Module):
    def __init__(self, spec: Transformer, causal: bool):
        super().__init__()
        self.heads, self.causal, self.dropout = spec.heads, causal, spec.dropout
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden)
        self.out = nn.Linear(spec.hidden, spec.hidden)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class _FeedForward(nn.Sequential):
    def __init__(self, spec: Transformer, approximate: str):
        super().__init__(nn.Linear(spec.hidden, spec.feed_forward), nn.GELU(approximate),
                         nn.Linear(spec.feed_forward, spec.hidden), nn.Dropout(spec.dropout))


class _PreLNBlock(nn.Module):  # GPT-2's: x + f(LN(x))
    def __init__(self, spec: Transformer):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(spec.hidden), nn.LayerNorm(spec.hidden)
        self.attention, self.drop = _Attention(spec, causal=True), nn.Dropout(spec.dropout)
        self.feed_forward = _FeedForward(spec, "tanh")

    def forward(self, x):
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.feed_forward(self.norm2(x))


class _PostLNBlock(nn.Module):  # BERT's: LN(x + f(x))
    def __init__(self, spec: Transformer):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(spec.hidden), nn.LayerNorm(spec.hidden)
        self.attention, self.drop = _Attention(spec, causal=False), nn.Dropout(spec.dropout)
        self.feed_forward = _FeedForward(spec, "none")

    def forward(self, x):
        x = self.norm1(x + self.drop(self.attention(x)))
        return self.norm2(x + self.feed_forward(x))


class GPT(nn.Module):
    """A GPT-2-shaped causal LM: token ids (batch, length) -> logits (batch, length, vocab)."""

    def __init__(self, spec: Transformer):
        super().__init__()
        self.tokens = nn.Embedding(spec.vocabulary, spec.hidden)
        self.positions = nn.Embedding(spec.sequence, spec.hidden)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.Sequential(*[_PreLNBlock(spec) for _ in range(spec.layers)])
        self.norm = nn.LayerNorm(spec.hidden)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.blocks(self.drop(self.tokens(ids) + self.positions(positions)))
        return self.norm(x) @ self.tokens.weight.t()  # tied to the input embedding


class Bert(nn.Module):
    """A BERT-shaped encoder classifier: token ids (batch, length) -> logits (batch, classes)
    (one segment: the segment embedding of id 0)."""

    def __init__(self, spec: Transformer):
        super().__init__()
        self.tokens = nn.Embedding(spec.vocabulary, spec.hidden)
        self.positions = nn.Embedding(spec.sequence, spec.hidden)
        self.segments = nn.Embedding(2, spec.hidden)
        self.norm, self.drop = nn.LayerNorm(spec.hidden), nn.Dropout(spec.dropout)
        self.blocks = nn.Sequential(*[_PostLNBlock(spec) for _ in range(spec.layers)])
        self.pooler = nn.Linear(spec.hidden, spec.hidden)
        self.classifier = nn.Linear(spec.hidden, spec.classes)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions) + self.segments.weight[0]
        x = self.blocks(self.drop(self.norm(x)))
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def _cifar_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25),
        nn.Flatten(), nn.Linear(64 * 6 * 6, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10))


def _mlp(inputs: int, width: int, depth: int) -> nn.Module:
    layers, size = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, 10))


def _torchvision(name: str) -> nn.Module:
    try:
        import torchvision
    except ImportError:
        raise SystemExit(f"mgpu-bench native: the native {name} is torchvision's, and "
                         f"torchvision is not installed here: pip install torchvision "
                         f"(the version that matches torch {torch.__version__})") from None
    if name == "inceptionv3":
        return torchvision.models.inception_v3(aux_logits=False, init_weights=False)
    return torchvision.models.resnet50()


def build(name: str):
    """The native torch model of mgpu-bench's `name` and its batch maker.

    Returns:
        (the ``nn.Module``, ``make_batch(batch, device, memory_format) -> (inputs, labels)``):
        random images in ``memory_format`` (NCHW logical shape), feature vectors, or token ids.
    """
    spec = MODELS[name]
    transformer = spec.transformer
    if transformer is not None:
        model = GPT(transformer) if transformer.kind == "gpt2" else Bert(transformer)

        def tokens(batch, device, memory_format=None):
            ids = torch.randint(0, transformer.vocabulary, (batch, transformer.sequence),
                                device=device)
            if transformer.kind == "gpt2":  # next-token labels: per position
                return ids, torch.randint(0, transformer.vocabulary, ids.shape, device=device)
            return ids, torch.randint(0, transformer.classes, (batch,), device=device)
        return model, tokens
    if name in ("resnet50", "inceptionv3"):
        model = _torchvision(name)
    elif name == "cifar-cnn":
        model = _cifar_cnn()
    else:
        inputs = spec.input_shape[0]
        model = _mlp(inputs, *{"mlp": (4096, 2), "mlp-tiny": (64, 1)}[name])
    shape = spec.shape("channels_first")  # torch's logical layout

    def features(batch, device, memory_format=torch.contiguous_format):
        x = torch.randn((batch,) + tuple(shape), device=device)
        if x.dim() == 4:
            x = x.to(memory_format=memory_format)
        return x, torch.randint(0, spec.classes, (batch,), device=device)
    return model, features


def loss(logits, labels):
    """Cross-entropy of logits (per token for a language model's (batch, length, vocab));
    float32 under autocast, as Keras's loss."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return F.cross_entropy(logits, labels)


def parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding once)."""
    return sum(p.numel() for p in model.parameters())
