"""Softmax regression with hand-written gradients, trained through arraytrain.Engine.

Gradients are written straight into the engine's flat gradient buffer
(``np.matmul(..., out=engine.grads[name])``): the zero-copy path, no dicts.
Runs in a few seconds: ``python examples/quickstart.py``.
"""

import time

import numpy as np

import arraytrain as at


def make_data(rng, n, classes=10, dim=64):
    centers = rng.standard_normal((classes, dim)).astype(np.float32) * 0.7
    y = rng.integers(0, classes, n)
    x = centers[y] + rng.standard_normal((n, dim)).astype(np.float32) * 2.0
    return x, y


def main(epochs=8, batch=128, seed=0):
    rng = np.random.default_rng(seed)
    x_all, y_all = make_data(rng, 24_000)
    x_train, y_train, x_test, y_test = x_all[:20_000], y_all[:20_000], x_all[20_000:], y_all[20_000:]
    dim, classes = x_train.shape[1], 10

    engine = at.Engine(
        {"W": rng.standard_normal((dim, classes)).astype(np.float32) * 0.01,
         "b": np.zeros(classes, np.float32)},
        at.optim.AdamW(lr=3e-3, weight_decay=1e-4),
        max_grad_norm=5.0,
        zero_grad_on_step=False,  # every step overwrites the gradients below
    )
    W, b = engine.params["W"], engine.params["b"]  # views: updated in place by every step
    gW, gb = engine.grads["W"], engine.grads["b"]

    t0 = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        losses = []
        for start in range(0, len(order) - batch + 1, batch):
            idx = order[start:start + batch]
            xb, yb = x_train[idx], y_train[idx]
            logits = xb @ W + b
            logits -= logits.max(axis=1, keepdims=True)
            prob = np.exp(logits)
            prob /= prob.sum(axis=1, keepdims=True)
            losses.append(-np.log(prob[np.arange(batch), yb] + 1e-12).mean())
            prob[np.arange(batch), yb] -= 1.0
            prob /= batch
            np.matmul(xb.T, prob, out=gW)   # dL/dW straight into the flat grad buffer
            np.sum(prob, axis=0, out=gb)
            report = engine.step()
        acc = ((x_test @ W + b).argmax(axis=1) == y_test).mean()
        print(f"epoch {epoch}: loss {np.mean(losses):.4f}  grad norm {report.grad_norm:.3f}  "
              f"test accuracy {acc:.3f}")
    print(f"{engine.state.step} optimizer steps in {time.perf_counter() - t0:.2f} s; final test accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
