"""Test models, each with a way to make a batch and a loss. Plain PyTorch; nothing knows about partita.

After RaNNC's test models (LeNet, fork/join, shared input, shared and tied weights, BatchNorm, a model
that returns its loss, integer inputs, no parameters), plus keyword inputs, a small GPT and HF models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from models import SmallGPT, TutorialMLP, lm_loss


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ForkJoin(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.left = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.right = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.out = nn.Linear(2 * d, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(torch.cat([self.left(h), self.right(h)], dim=1))


class SharedInput(nn.Module):
    """One input read by several branches, in different stages."""

    def __init__(self, d=16):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h) + x)
        h = torch.tanh(self.c(h) * x)
        return self.out(h + x)


class SharedLinear(nn.Module):
    """One Linear module applied at the start and the end: its weight lands in two stages."""

    def __init__(self, d=16):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.middle = nn.Sequential(*[nn.Linear(d, d) for _ in range(4)])
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.middle(h))
        return self.out(torch.tanh(self.shared(h)))


class TiedEmbedding(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh())
        self.proj = nn.Linear(d, vocab, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, ids):
        return self.proj(self.mid(self.emb(ids)))


class BatchNormNet(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.l1 = nn.Linear(d, 32)
        self.bn1 = nn.BatchNorm1d(32)
        self.l2 = nn.Linear(32, 32)
        self.bn2 = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.l1(x)))
        h = torch.relu(self.bn2(self.l2(h)))
        return self.out(h)


class ResidualBlock(nn.Module):
    """torchvision's BasicBlock: the residual added in place (`out += identity`), a 1x1 convolution on the
    shortcut where the shape changes."""

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        identity = x
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return F.relu(out)


class SmallResNet(nn.Module):
    """A ResNet as torchvision writes it, small: a stem, four residual blocks (two with a downsampling
    shortcut), global pooling and a classifier."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layers = nn.Sequential(ResidualBlock(8, 8), ResidualBlock(8, 16, 2), ResidualBlock(16, 16),
                                    ResidualBlock(16, 16, 2))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class WriteIntoView(nn.Module):
    """Writes in place into views of a value that earlier layers made: a slice (`h[:, 8:] += ...`) and a view
    taken before the next layers ran (`head.add_(...)`); then reads the whole value."""

    def __init__(self, d=16):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.d = nn.Linear(d, d)
        self.out = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 4))

    def forward(self, x):
        h = self.a(x)
        head = h[:, :4]
        g = torch.tanh(self.b(x))
        h[:, 8:] += self.c(g)[:, 8:]
        head.add_(self.d(g)[:, :4])
        return self.out(torch.tanh(h) * g)


class LossOut(nn.Module):
    """Takes the target as a second input and returns its own (mean) loss."""

    def __init__(self, d=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x, y):
        return F.mse_loss(self.body(x), y)


class KeywordInputs(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)
        self.l3 = nn.Linear(d, 4)

    def forward(self, x, *, mask=None, scale: float = 1.0):
        h = torch.relu(self.l1(x))
        if mask is not None:
            h = h * mask
        h = torch.relu(self.l2(h)) * scale
        return self.l3(h)


class EmbeddingNet(nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, 4)

    def forward(self, ids):
        h = self.emb(ids).mean(dim=1)
        return self.l2(torch.relu(self.l1(h)))


class NoParams(nn.Module):
    def forward(self, x):
        h = torch.tanh(x) * 2
        h = torch.sin(h) + x
        return torch.relu(h).reshape(h.shape[0], -1)


def _hf(name: str) -> nn.Module:
    import transformers as tr

    if name == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if name == "bert":
        return tr.BertForSequenceClassification(tr.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=3))
    if name == "llama":
        return tr.LlamaForCausalLM(tr.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, vocab_size=64, max_position_embeddings=32, use_cache=False,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    if name == "resnet":  # HF ResNet's residual: `hidden_state += residual`
        return tr.ResNetForImageClassification(tr.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], layer_type="basic", num_labels=4))
    raise KeyError(name)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@dataclass
class Case:
    """A model, a batch maker and a loss: everything a fidelity test needs."""

    make: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[tuple, dict, torch.Tensor]]  # rows -> args, kwargs, target
    loss_fn: Callable | None  # called as loss_fn(output, target); None: the model returns its loss
    user_loss: Callable  # for the call style without loss_fn: loss of one rank's output rows and target


def _dense(d, classes=4):
    def batch(n, g):
        return (torch.randn(n, d, generator=g),), {}, torch.randint(0, classes, (n,), generator=g)
    return batch


def _regress(shape, out):
    def batch(n, g):
        return (torch.randn(n, *shape, generator=g),), {}, torch.randn(n, *out, generator=g)
    return batch


def _tokens(vocab, seq, classes=None):
    def batch(n, g):
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        if classes:
            return (ids,), {}, torch.randint(0, classes, (n,), generator=g)
        return (ids,), {}, torch.randint(0, vocab, (n, seq), generator=g)
    return batch


def _ce(out, y):
    return F.cross_entropy(_logits(out), y)


def _mse(out, y):
    return F.mse_loss(_logits(out), y)


def _lm(out, y):
    return lm_loss(_logits(out), y)


def _own_loss(out, y):
    return out


def _kw_batch(n, g):
    x = torch.randn(n, 16, generator=g)
    mask = (torch.rand(n, 16, generator=g) > 0.3).float()
    return (x,), {"mask": mask, "scale": 0.5}, torch.randint(0, 4, (n,), generator=g)


def _lossout_batch(n, g):
    x, y = torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
    return (x, y), {}, y


def _bert_batch(n, g):
    ids = torch.randint(0, 64, (n, 12), generator=g)
    mask = torch.ones(n, 12, dtype=torch.long)
    mask[:, 9:] = (torch.rand(n, 3, generator=g) > 0.5).long()
    return (), {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (n,), generator=g)


def _images(n, g):
    return (torch.randn(n, 3, 8, 8, generator=g),), {}, torch.randint(0, 4, (n,), generator=g)


def _hf_lm_batch(n, g):
    ids = torch.randint(0, 64, (n, 12), generator=g)
    return (), {"input_ids": ids}, torch.randint(0, 64, (n, 12), generator=g)


CASES: dict[str, Case] = {
    "mlp": Case(lambda: TutorialMLP(32, 6), _regress((32,), (32,)), nn.MSELoss(), _mse),
    "lenet": Case(LeNet, lambda n, g: ((torch.randn(n, 1, 28, 28, generator=g),), {},
                                       torch.randint(0, 10, (n,), generator=g)), nn.CrossEntropyLoss(), _ce),
    "forkjoin": Case(ForkJoin, _dense(16), nn.CrossEntropyLoss(), _ce),
    "shared_input": Case(SharedInput, _dense(16), nn.CrossEntropyLoss(), _ce),
    "shared_linear": Case(SharedLinear, _dense(16), nn.CrossEntropyLoss(), _ce),
    "tied_embedding": Case(TiedEmbedding, _tokens(50, 6), _lm, _lm),
    "batchnorm": Case(BatchNormNet, _dense(16), nn.CrossEntropyLoss(), _ce),
    "loss_out": Case(LossOut, _lossout_batch, None, _own_loss),
    "keywords": Case(KeywordInputs, _kw_batch, nn.CrossEntropyLoss(), _ce),
    "embedding": Case(EmbeddingNet, _tokens(40, 5, classes=4), nn.CrossEntropyLoss(), _ce),
    "no_params": Case(NoParams, _regress((4, 4), (16,)), nn.MSELoss(), _mse),
    "gpt": Case(lambda: SmallGPT(vocab=64, dim=32, heads=2, layers=2, context=16), _tokens(64, 8), _lm, _lm),
    "write_into_view": Case(WriteIntoView, _dense(16), nn.CrossEntropyLoss(), _ce),
    "resnet": Case(SmallResNet, _images, nn.CrossEntropyLoss(), _ce),
    "hf_resnet": Case(lambda: _hf("resnet"), _images, _ce, _ce),
    "hf_gpt2": Case(lambda: _hf("gpt2"), _hf_lm_batch, _lm, _lm),
    "hf_bert": Case(lambda: _hf("bert"), _bert_batch, _ce, _ce),
    "hf_llama": Case(lambda: _hf("llama"), _hf_lm_batch, _lm, _lm),
}
