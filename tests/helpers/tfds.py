"""A tiny TFDS translation builder (registered on import, as TFDS registers every builder class) and a data config
that reads it, so TFDS tests prepare a dataset in a temporary directory without a download."""

from __future__ import annotations

import tensorflow_datasets as tfds

from configs import common


class TransformerJaxTinyTranslate(tfds.core.GeneratorBasedBuilder):
    """A three-language translation builder small enough to prepare in a test."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="de-en"), tfds.core.BuilderConfig(name="fr-en")]

    def _info(self):
        languages = tuple(self.builder_config.name.split("-"))
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.Translation(languages=languages))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(7), "validation": self._generate_examples(3)}

    def _generate_examples(self, n):
        a, b = self.builder_config.name.split("-")
        for i in range(n):
            yield i, {a: f"{a} Satz {i} \u00e4\u00df", b: f"{b} sentence {i}"}


class TransformerJaxOfflineTranslate(TransformerJaxTinyTranslate):
    """Preparing it fails the way a download without internet does."""

    def _split_generators(self, dl_manager):
        raise ConnectionError("Failed to resolve 'www.statmt.org'")


def tfds_config(tmp_path, name="transformer_jax_tiny_translate/de-en", src="en", tgt="de", download=True):
    config = common.data_config()
    config.source, config.tfds_name, config.tfds_data_dir = "tfds", name, str(tmp_path)
    config.src_lang, config.tgt_lang, config.tfds_download = src, tgt, download
    return config
