"""The stages, each a recipe ``stage(cfg) -> result`` over one validated config
(:class:`specforge.config.SpecForgeConfig`): ``prepare``, ``capture``, ``train``, ``export``,
``bench``, and ``quickstart``, which chains them on the embedded default. The ``specforge``
command and ``scripts/`` are thin layers over these functions; call them from Python the same
way::

    from specforge.config import load_config
    from specforge.recipes.train import train

    result = train(load_config("configs/smollm2-135m-eagle3.yaml", ["train.max_steps=10"]))
"""
