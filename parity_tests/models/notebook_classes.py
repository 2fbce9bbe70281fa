"""The notebooks' own classes, transcribed for checkpoint-compatibility tests only.

These are the seed notebooks' definitions (000, 001, 004), with their bugs, so the
tests can prove that a state_dict saved by a notebook model loads into
torch_reference and gives the same outputs. Changes, all outside the math: the
``device`` global notebook 000 reads is defined here as the CPU, notebook 001's debug
``print`` calls are dropped, and ``math.sqrt`` replaces its ``from math import sqrt``.
Nothing in the library imports this file.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

device = torch.device("cpu")


# ------------------------------------------------------------------ notebook 000


class MHSelfAttention(nn.Module):
    def __init__(self, emb, heads=8):
        super().__init__()
        assert emb % heads == 0
        self.emb = emb
        self.heads = heads
        self.tokeys = nn.Linear(emb, emb, bias=False)
        self.toqueries = nn.Linear(emb, emb, bias=False)
        self.tovalues = nn.Linear(emb, emb, bias=False)
        self.unifyheads = nn.Linear(emb, emb)

    def forward(self, x):
        b, t, e = x.size()
        h = self.heads
        s = e // h
        keys = self.tokeys(x)
        queries = self.toqueries(x)
        values = self.tovalues(x)
        keys = keys.view(b, t, h, s)
        queries = queries.view(b, t, h, s)
        values = values.view(b, t, h, s)
        keys = keys.transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries.transpose(1, 2).contiguous().view(b * h, t, s)
        values = values.transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries / (e ** (1 / 4))
        keys = keys / (e ** (1 / 4))
        attn_scores = torch.bmm(queries, keys.transpose(1, 2))
        attn_weights = F.softmax(attn_scores, dim=2)
        out = torch.bmm(attn_weights, values).view(b, h, t, s)
        out = out.transpose(1, 2).contiguous().view(b, t, s * h)
        return self.unifyheads(out)


class TransformerBlock(nn.Module):
    def __init__(self, emb, heads, mask, seq_length, ff_hidden_mult=4, dropout=0.0, pos_embedding=None):
        super().__init__()
        self.mhattention = MHSelfAttention(emb, heads=heads)
        self.norm1 = nn.LayerNorm(emb)
        self.norm2 = nn.LayerNorm(emb)
        self.ff = nn.Sequential(
            nn.Linear(emb, ff_hidden_mult * emb),
            nn.ReLU(),
            nn.Linear(ff_hidden_mult * emb, emb),
        )
        self.do = nn.Dropout(dropout)

    def forward(self, x):
        attended = self.mhattention(x)
        x = self.norm1(attended + x)
        x = self.do(x)
        fedforward = self.ff(x)
        x = self.norm2(fedforward + x)
        x = self.do(x)
        return x


class CTransformer(nn.Module):
    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, max_pool=True, dropout=0.0):
        super().__init__()
        self.num_tokens, self.max_pool = num_tokens, max_pool
        self.token_embedding = nn.Embedding(embedding_dim=emb, num_embeddings=num_tokens)
        self.pos_embedding = nn.Embedding(embedding_dim=emb, num_embeddings=seq_length)
        tblocks = []
        for i in range(depth):  # noqa: B007  (the notebook's loop, transcribed as it is)
            tblocks.append(TransformerBlock(emb=emb, heads=heads, seq_length=seq_length, mask=False, dropout=dropout))
        self.tblocks = nn.Sequential(*tblocks)
        self.toprobs = nn.Linear(emb, num_classes)
        self.do = nn.Dropout(dropout)

    def forward(self, x):
        tokens = self.token_embedding(x)
        b, t, e = tokens.size()
        positions = self.pos_embedding(torch.arange(t, device=device))[None, :, :].expand(b, t, e)
        x = tokens + positions
        x = self.do(x)
        x = self.tblocks(x)
        x = x.max(dim=1)[0] if self.max_pool else x.mean(dim=1)
        x = self.toprobs(x)
        return F.log_softmax(x, dim=1)


# ------------------------------------------------------------------ notebook 004


class SelfAttention(nn.Module):
    def __init__(self, k, heads=8):
        super().__init__()
        self.k, self.heads = k, heads
        self.tokeys = nn.Linear(k, k * heads, bias=False)
        self.toqueries = nn.Linear(k, k * heads, bias=False)
        self.tovalues = nn.Linear(k, k * heads, bias=False)
        self.unifyheads = nn.Linear(heads * k, k)

    def forward(self, x):
        b, t, k = x.size()
        h = self.heads
        queries = self.toqueries(x).view(b, t, h, k)
        keys = self.tokeys(x).view(b, t, h, k)
        values = self.tovalues(x).view(b, t, h, k)
        keys = keys.transpose(1, 2).contiguous().view(b * h, t, k)
        queries = queries.transpose(1, 2).contiguous().view(b * h, t, k)
        values = values.transpose(1, 2).contiguous().view(b * h, t, k)
        queries = queries / (k ** (1 / 4))
        keys = keys / (k ** (1 / 4))
        dot = torch.bmm(queries, keys.transpose(1, 2))
        dot = F.softmax(dot, dim=2)
        out = torch.bmm(dot, values).view(b, h, t, k)
        out = out.transpose(1, 2).contiguous().view(b, t, h * k)
        return self.unifyheads(out)


# ------------------------------------------------------------------ notebook 001


def scaled_dot_product_attention(query, key, value, mask=None):
    dim_k = query.size(-1)
    scores = torch.bmm(query, key.transpose(1, 2)) / math.sqrt(dim_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    return weights.bmm(value)


class AttentionHead(nn.Module):
    def __init__(self, embed_dim, head_dim):
        super().__init__()
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, hidden_state):
        return scaled_dot_product_attention(self.q(hidden_state), self.k(hidden_state), self.v(hidden_state))


class MultiHeadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        embed_dim = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = embed_dim // num_heads
        self.heads = nn.ModuleList([AttentionHead(embed_dim, head_dim) for _ in range(num_heads)])
        self.output_linear = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_state):
        x = torch.cat([h(hidden_state) for h in self.heads], dim=-1)
        return self.output_linear(x)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.gelu = nn.GELU()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x):
        x = self.linear_1(x)
        x = self.gelu(x)
        x = self.linear_2(x)
        x = self.dropout(x)
        return x


class TransformerEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm_1 = nn.LayerNorm(config.hidden_size)
        self.layer_norm_2 = nn.LayerNorm(config.hidden_size)
        self.attention = MultiHeadAttention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x):
        hidden_state = self.layer_norm_1(x)
        x = x + self.attention(hidden_state)
        x = x + self.feed_forward(self.layer_norm_2(x))
        return x


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout()

    def forward(self, input_ids):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0)
        token_embeddings = self.token_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        embeddings = token_embeddings + position_embeddings
        embeddings = self.layer_norm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class TransformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList([TransformerEncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, x):
        x = self.embeddings(x)
        for layer in self.layers:
            x = layer(x)
        return x


class TransformerForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.encoder = TransformerEncoder(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x):
        x = self.encoder(x)[:, 0, :]
        x = self.dropout(x)
        x = self.classifier(x)
        return x


# ------------------------------------------------------------------ notebook 002
# (the GPT from scratch: its own Linear/LayerNorm, the final multi-head classes)

INF = 1e20


class Linear(nn.Module):
    def __init__(self, d_in, d_out, bias=True):
        super().__init__()
        self.matrix = nn.Parameter(0.02 * torch.randn(d_in, d_out))
        if bias:
            self.bias = nn.Parameter(0.02 * torch.randn(d_out))

    def forward(self, x):
        results = x @ self.matrix
        if hasattr(self, "bias"):
            results += self.bias
        return results


def ReLU(x):
    return x * (x > 0)


class GPTFeedForward(nn.Module):  # the notebook's ``FeedForward``
    def __init__(self, d_embed, d_ff, dropout=0.1):
        super().__init__()
        self.w1 = Linear(d_embed, d_ff)
        self.w2 = Linear(d_ff, d_embed)
        self.act_fn = ReLU
        self.dropout = dropout

    def forward(self, x):
        z = self.w1(x)
        z = self.act_fn(z)
        z = F.dropout(z, p=self.dropout)
        z = self.w2(z)
        return z


class LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(d))
        self.beta = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        std = x.std(dim=-1, keepdim=True)
        return self.gamma * (x - mean) / (std + self.eps) + self.beta


class GPTMHAttention(nn.Module):
    def __init__(self, d_embed, n_heads):
        super().__init__()
        self.q_proj = nn.Linear(d_embed, d_embed, bias=False)
        self.k_proj = nn.Linear(d_embed, d_embed, bias=False)
        self.v_proj = nn.Linear(d_embed, d_embed, bias=False)
        assert (d_embed % n_heads) == 0
        self.n_heads = n_heads

    def forward(self, x, attention_mask):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        batch_size, seq_len, d_embed = x.shape
        q = q.reshape(batch_size, seq_len, self.n_heads, -1).transpose(1, 2)
        k = k.reshape(batch_size, seq_len, self.n_heads, -1).transpose(1, 2)
        v = v.reshape(batch_size, seq_len, self.n_heads, -1).transpose(1, 2)
        s_ij = q @ k.transpose(-1, -2)
        d = k.shape[-1]
        s_ij = s_ij * (d**-0.5)
        mask = torch.ones_like(s_ij)
        mask = torch.triu(mask, diagonal=1)
        attention_mask = 1.0 - attention_mask
        mask = mask + attention_mask[:, None, None]
        mask = mask.float() * (-INF)
        s_ij = s_ij + mask
        a_ij = torch.softmax(s_ij, dim=-1)
        y = a_ij @ v
        y = y.transpose(2, 1)
        y = y.reshape(batch_size, seq_len, d_embed)
        return y


class GPTMHTransformerLayer(nn.Module):
    def __init__(self, d_embed, d_ff, n_heads, dropout=0.1):
        super().__init__()
        self.attention = GPTMHAttention(d_embed, n_heads)
        self.layer_norm_attention = LayerNorm(d_embed)
        self.layer_norm_feed_forward = LayerNorm(d_embed)
        self.dropout = dropout
        self.feed_forward = GPTFeedForward(d_embed, d_ff, dropout=self.dropout)

    def forward(self, x, attention_mask):
        z = self.attention(x, attention_mask)
        z = F.dropout(z, p=self.dropout, training=self.training)
        z = z + x
        z = self.layer_norm_attention(z)
        y = self.feed_forward(z)
        y = y + z
        y = self.layer_norm_feed_forward(y)
        return y


class GPTTransformer(nn.Module):
    def __init__(self, n_layers, d_embed, d_ff, n_heads, voc_size, max_length, dropout=0.1):
        super().__init__()
        self.n_layers = n_layers
        self.d_embed = d_embed
        self.d_ff = d_ff
        self.num_heads = n_heads
        self.max_length = max_length
        self.voc_size = voc_size
        self.dropout = dropout
        self.transformer_stack = nn.ModuleList(
            [GPTMHTransformerLayer(d_embed=d_embed, d_ff=d_ff, n_heads=n_heads, dropout=self.dropout)]
        )
        self.token_embeddings = nn.Embedding(num_embeddings=self.voc_size, embedding_dim=self.d_embed)
        self.position_embeddings = nn.Embedding(num_embeddings=self.max_length, embedding_dim=self.d_embed)
        self.out_layer_norm = LayerNorm(self.d_embed)
        self.embedding_norm = LayerNorm(self.d_embed)
        self.lm_head = nn.Linear(self.d_embed, self.voc_size)

    def forward(self, input_ids, attention_mask):
        token_vectors = self.token_embeddings(input_ids)
        position_vectors = self.position_embeddings(torch.arange(input_ids.shape[-1], device=input_ids.device))[None, :, :]
        z = token_vectors + position_vectors
        z = self.embedding_norm(z)
        for layer in self.transformer_stack:
            z = layer(z, attention_mask) + z
        y = self.out_layer_norm(z)
        logits = self.lm_head(y)
        return logits


# ------------------------------------------------------------------ notebook 003
# (its shape logging is dropped: it inspects the call stack for ``self``)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k = k.size(-1)
        attn = torch.bmm(q, k.transpose(1, 2))
        attn = attn / math.sqrt(d_k)
        attn = torch.exp(attn)
        if mask is not None:
            attn = attn.masked_fill(mask, 0)
        attn = attn / attn.sum(dim=-1, keepdim=True)
        attn = self.dropout(attn)
        return torch.bmm(attn, v)


class ClassicAttentionHead(nn.Module):  # the notebook's ``AttentionHead`` (003)
    def __init__(self, d_model, d_feature, dropout=0.1):
        super().__init__()
        self.attn = ScaledDotProductAttention(dropout)
        self.query_tfm = nn.Linear(d_model, d_feature)
        self.key_tfm = nn.Linear(d_model, d_feature)
        self.value_tfm = nn.Linear(d_model, d_feature)

    def forward(self, queries, keys, values, mask=None):
        Q = self.query_tfm(queries)
        K = self.key_tfm(keys)
        V = self.value_tfm(values)
        return self.attn(Q, K, V)


class ClassicMultiHeadAttention(nn.Module):  # the notebook's ``MultiHeadAttention`` (003)
    def __init__(self, d_model, d_feature, n_heads, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.d_feature = d_feature
        self.n_heads = n_heads
        assert d_model == d_feature * n_heads
        self.attn_heads = nn.ModuleList([ClassicAttentionHead(d_model, d_feature, dropout) for _ in range(n_heads)])
        self.projection = nn.Linear(d_feature * n_heads, d_model)

    def forward(self, queries, keys, values, mask=None):
        x = [attn(queries, keys, values, mask=mask) for i, attn in enumerate(self.attn_heads)]
        x = torch.cat(x, dim=2)
        return self.projection(x)
