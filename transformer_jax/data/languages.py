"""Many languages in one model: the directions a run trains (`data.directions`), the language tokens and where they
go (`model.lang_token`), and the temperature that samples the directions (`data.temperature`). Every other module
asks this one.

Directions: `src-tgt` names of a multi-way text folder's languages (`{split}.{lang}`, line i the same sentence in
every language), or the shorthands `all` (every ordered pair of the folder's languages that have the training split)
and `LANG-centric` (to and from LANG). `expand_config` writes the explicit tuple into the config before anything is
saved, so a saved config always holds it and a restart must match it.

Language tokens: one id per language of the run, after the SentencePiece pieces (as NLLB lays out its codes): the
tokenizer is trained with model.vocab_size - (number of languages) pieces, and language i (in sorted order) is
id vocab_size - L + i. A converted model (M2M-100, NLLB-200) brings its own table instead, model.language_codes
(`__en__` or `eng_Latn` -> id), whatever data.directions names. Text never produces them and detokenising drops
them. A user names a language by its file suffix, its code, `>>xx<<` (Marian's spelling), `__xx__` (M2M-100's),
or its ISO 639-1 or 639-3 name (`resolve`: `en` finds `eng_Latn`). Where the ids go (`Placement`), by
model.lang_token:
- `none`: nowhere (bilingual models);
- `source`: the target language's token starts the source (Johnson et al. 2017);
- `target`: the target language's token is the decoder's first token after the start (mBART, M2M-100): the loss
  predicts it, decoding forces it;
- `source_and_target`: as `target`, and the source language's own token starts the source (NLLB-200, M2M-100).
They are inserted when batches are assembled, never into the text or the tokenized store; the length filter counts
them.

Temperature: direction d is drawn with probability proportional to w_d * n_d^(1/T), n_d its pairs before the length
filter and w_d its corpus weight (1 for the directions of data.directions): T = 1 samples in proportion to the data,
T -> infinity uniformly (Arivazhagan et al. 2019 use T = 5). The tokenizer's training sample is balanced across
language sides the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Sequence
from pathlib import Path

import ml_collections
import numpy as np

from transformer_jax.config.schema import LANG_TOKENS as SCHEMES
from transformer_jax.data import sources
from transformer_jax.errors import ConfigError, DataError

ALL = "all"
CENTRIC = "-centric"


@dataclasses.dataclass(frozen=True, order=True)
class Direction:
    src: str
    tgt: str

    @property
    def name(self) -> str:
        return f"{self.src}-{self.tgt}"

    @classmethod
    def parse(cls, entry: str) -> Direction:
        src, dash, tgt = entry.partition("-")
        if not dash or not src or not tgt or "-" in tgt or src == tgt:
            raise ConfigError(
                f"data.directions: {entry!r} is not SRC-TGT (two different language suffixes of data.text_dir), "
                f"{ALL!r} or LANG{CENTRIC}"
            )
        return cls(src, tgt)


def folder_languages(directory: str | Path, split: str) -> list[str]:
    """The languages of a multi-way folder that have `split` ({split}.{lang} files), sorted."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise DataError(f"text data directory {directory} does not exist (data.text_dir)")
    return sorted(f.name[len(split) + 1 :] for f in directory.glob(f"{split}.*") if f.is_file())


def expand(entries: Sequence[str], available: Sequence[str], where: str) -> tuple[str, ...]:
    """The explicit SRC-TGT names of `entries` (shorthands expanded against the `available` languages, each name
    once, in order); ConfigError for a language that `where` (the folder) lacks."""
    out: list[str] = []
    for entry in entries:
        if entry == ALL:
            names = [f"{s}-{t}" for s in available for t in available if s != t]
        elif entry.endswith(CENTRIC):
            hub = entry[: -len(CENTRIC)]
            if hub not in available:
                raise ConfigError(
                    f"data.directions: {entry!r}: {where} has no language {hub!r}; it has {list(available)}"
                )
            names = [n for other in available if other != hub for n in (f"{hub}-{other}", f"{other}-{hub}")]
        else:
            d = Direction.parse(entry)
            for lang in (d.src, d.tgt):
                if lang not in available:
                    raise ConfigError(
                        f"data.directions: {entry!r}: {where} has no language {lang!r}; it has {list(available)}"
                    )
            names = [d.name]
        out += [n for n in names if n not in out]
    if not out:
        raise ConfigError(f"data.directions: {list(entries)} gives no direction: {where} has {list(available)}")
    return tuple(out)


def trained(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The directions a run's model was trained on: those of its chain of train.init_from sources
    (train.source_directions, which a config saved before the key lacks), then its own data.directions."""
    return tuple(dict.fromkeys((*config.train.get("source_directions", ()), *config.data.directions)))


def expand_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config with data.directions explicit (unchanged when it is empty or explicit already), checked against
    the folder, and data.direction_lines against the directions."""
    entries = tuple(config.data.directions)
    if entries:
        available = folder_languages(config.data.text_dir, config.data.train_split)
        expanded = expand(entries, available, config.data.text_dir)
        if expanded != entries:
            config = ml_collections.ConfigDict(config.to_dict())
            config.data.directions = expanded
    line_limits(config.data)
    return config


def line_limits(data: ml_collections.ConfigDict) -> dict[str, int]:
    """data.direction_lines by direction name: a direction trained on its first lines only (ConfigError for one that
    is not among data.directions)."""
    limits = {name: int(lines) for name, lines in data.direction_lines}
    unknown = sorted(set(limits) - set(data.directions))
    if unknown:
        raise ConfigError(
            f"data.direction_lines names {unknown}, which data.directions {list(data.directions)} does not train"
        )
    return limits


def language_lines(data: ml_collections.ConfigDict, lang: str, lines: int) -> int:
    """How many of a language file's first `lines` lines some direction trains on (all, unless every direction
    with that language is limited by data.direction_lines): what the tokenizer's sample draws from."""
    limits = line_limits(data)
    used = [limits.get(d.name, lines) for d in directions(data) if lang in (d.src, d.tgt)]
    return min(lines, max(used, default=lines))


def directions(data: ml_collections.ConfigDict) -> list[Direction]:
    """The run's directions (`data` is the data group; explicit, as expand_config leaves it); empty: bilingual."""
    return [Direction.parse(entry) for entry in data.directions]


def languages(data: ml_collections.ConfigDict) -> list[str]:
    """Every language of the run's directions, sorted: the order of their token ids."""
    return sorted({lang for d in directions(data) for lang in (d.src, d.tgt)})


def code(lang: str) -> str:
    """A language's token as text: `>>xx<<`, Marian's spelling (data.target_lang's)."""
    return f">>{lang}<<"


# The language codes of the converted families, in their tokenizers' order (transformers' NllbTokenizer and
# M2M100Tokenizer; tests/test_language_names.py checks them equal): NLLB-200's `eng_Latn` (ISO 639-3 and script)
# and M2M-100's `xx` (its tokens are `__xx__`), by the tokenizer_config.json name `language_codes`.
NLLB_CODES = tuple(
    """ace_Arab ace_Latn acm_Arab acq_Arab aeb_Arab afr_Latn ajp_Arab aka_Latn amh_Ethi apc_Arab arb_Arab ars_Arab
    ary_Arab arz_Arab asm_Beng ast_Latn awa_Deva ayr_Latn azb_Arab azj_Latn bak_Cyrl bam_Latn ban_Latn bel_Cyrl
    bem_Latn ben_Beng bho_Deva bjn_Arab bjn_Latn bod_Tibt bos_Latn bug_Latn bul_Cyrl cat_Latn ceb_Latn ces_Latn
    cjk_Latn ckb_Arab crh_Latn cym_Latn dan_Latn deu_Latn dik_Latn dyu_Latn dzo_Tibt ell_Grek eng_Latn epo_Latn
    est_Latn eus_Latn ewe_Latn fao_Latn pes_Arab fij_Latn fin_Latn fon_Latn fra_Latn fur_Latn fuv_Latn gla_Latn
    gle_Latn glg_Latn grn_Latn guj_Gujr hat_Latn hau_Latn heb_Hebr hin_Deva hne_Deva hrv_Latn hun_Latn hye_Armn
    ibo_Latn ilo_Latn ind_Latn isl_Latn ita_Latn jav_Latn jpn_Jpan kab_Latn kac_Latn kam_Latn kan_Knda kas_Arab
    kas_Deva kat_Geor knc_Arab knc_Latn kaz_Cyrl kbp_Latn kea_Latn khm_Khmr kik_Latn kin_Latn kir_Cyrl kmb_Latn
    kon_Latn kor_Hang kmr_Latn lao_Laoo lvs_Latn lij_Latn lim_Latn lin_Latn lit_Latn lmo_Latn ltg_Latn ltz_Latn
    lua_Latn lug_Latn luo_Latn lus_Latn mag_Deva mai_Deva mal_Mlym mar_Deva min_Latn mkd_Cyrl plt_Latn mlt_Latn
    mni_Beng khk_Cyrl mos_Latn mri_Latn zsm_Latn mya_Mymr nld_Latn nno_Latn nob_Latn npi_Deva nso_Latn nus_Latn
    nya_Latn oci_Latn gaz_Latn ory_Orya pag_Latn pan_Guru pap_Latn pol_Latn por_Latn prs_Arab pbt_Arab quy_Latn
    ron_Latn run_Latn rus_Cyrl sag_Latn san_Deva sat_Beng scn_Latn shn_Mymr sin_Sinh slk_Latn slv_Latn smo_Latn
    sna_Latn snd_Arab som_Latn sot_Latn spa_Latn als_Latn srd_Latn srp_Cyrl ssw_Latn sun_Latn swe_Latn swh_Latn
    szl_Latn tam_Taml tat_Cyrl tel_Telu tgk_Cyrl tgl_Latn tha_Thai tir_Ethi taq_Latn taq_Tfng tpi_Latn tsn_Latn
    tso_Latn tuk_Latn tum_Latn tur_Latn twi_Latn tzm_Tfng uig_Arab ukr_Cyrl umb_Latn urd_Arab uzn_Latn vec_Latn
    vie_Latn war_Latn wol_Latn xho_Latn ydd_Hebr yor_Latn yue_Hant zho_Hans zho_Hant zul_Latn""".split()
)
M2M100_CODES = {
    "m2m100": tuple(
        """af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi hr ht
        hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or pa pl ps
        pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu""".split()
    ),
    "wmt21": ("en", "ha", "is", "ja", "cs", "ru", "zh", "de"),
}

# The name table: an ISO 639-1 name (and M2M-100's `ns`) -> the ISO 639-3 code NLLB-200 spells. For a
# macrolanguage, the individual language NLLB-200 has (ar: Standard Arabic arb, fa: Western Persian pes, ms:
# Standard Malay zsm, lv: Standard Latvian lvs, uz: Northern Uzbek uzn, sw: Swahili swh, ne: npi, mn: Halh khk,
# az: North Azerbaijani azj, sq: Tosk als, ps: Southern Pashto pbt, om: West Central Oromo gaz, mg: Plateau
# Malagasy plt, ff: Nigerian Fulfulde fuv, ku: Kurmanji kmr, qu: Ayacucho quy, ay: Central Aymara ayr, kr: Central
# Kanuri knc, no and nb: Bokmal nob, yi: Eastern Yiddish ydd); et, zh, ks and kg keep the macrolanguage's code,
# which NLLB-200 spells so. br (bre) and fy (fry) are M2M-100's only.
ISO639_3 = dict(
    pair.split(":")
    for pair in """af:afr ak:aka am:amh ar:arb as:asm ay:ayr az:azj ba:bak be:bel bg:bul bm:bam bn:ben bo:bod br:bre
    bs:bos ca:cat cs:ces cy:cym da:dan de:deu dz:dzo ee:ewe el:ell en:eng eo:epo es:spa et:est eu:eus fa:pes ff:fuv
    fi:fin fj:fij fo:fao fr:fra fy:fry ga:gle gd:gla gl:glg gn:grn gu:guj ha:hau he:heb hi:hin hr:hrv ht:hat hu:hun
    hy:hye id:ind ig:ibo is:isl it:ita ja:jpn jv:jav ka:kat kg:kon ki:kik kk:kaz km:khm kn:kan ko:kor kr:knc ks:kas
    ku:kmr ky:kir lb:ltz lg:lug li:lim ln:lin lo:lao lt:lit lv:lvs mg:plt mi:mri mk:mkd ml:mal mn:khk mr:mar ms:zsm
    mt:mlt my:mya nb:nob ne:npi nl:nld nn:nno no:nob ns:nso ny:nya oc:oci om:gaz or:ory pa:pan pl:pol ps:pbt pt:por
    qu:quy rn:run ro:ron ru:rus rw:kin sa:san sc:srd sd:snd sg:sag si:sin sk:slk sl:slv sm:smo sn:sna so:som sq:als
    sr:srp ss:ssw st:sot su:sun sv:swe sw:swh ta:tam te:tel tg:tgk th:tha ti:tir tk:tuk tl:tgl tn:tsn tr:tur ts:tso
    tt:tat tw:twi ug:uig uk:ukr ur:urd uz:uzn vi:vie wo:wol xh:xho yi:ydd yo:yor zh:zho zu:zul""".split()
)


def bare(name: str) -> str:
    """`name` without Marian's `>>x<<` or M2M-100's `__x__` around it."""
    for left, right in ((">>", "<<"), ("__", "__")):
        if len(name) > len(left + right) and name.startswith(left) and name.endswith(right):
            return name[len(left) : -len(right)]
    return name


def resolve(name: str, codes: Collection[str]) -> str:
    """The one of a model's `codes` that a user's `name` means: the code itself; its spellings `>>x<<` and `__x__`
    (of the name, and of its part before `_`: `ast_Latn` -> `__ast__`); through ISO639_3 (2 letters to NLLB-200's
    3, and 3 back to 2 for M2M-100's `__xx__`: `eng_Latn` -> `__en__`); then the codes whose part before `_` is
    those 3 letters (`en` -> `eng_Latn`). ConfigError where none or several match."""
    if name in codes:
        return name
    bare_name = bare(name)
    prefix = bare_name.split("_")[0]
    three = ISO639_3.get(prefix, prefix)
    twos = [two for two, code3 in ISO639_3.items() if three == code3]
    for candidate in (x for b in (bare_name, prefix, *twos) for x in (b, f">>{b}<<", f"__{b}__")):
        if candidate in codes:
            return candidate
    found = [c for c in codes if three and c.split("_")[0] == three]
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"language {name!r} is more than one of the model's codes: give one of {found}")
    listed = sorted(codes)
    few = f"{listed}" if len(listed) <= 12 else f"{listed[:8]} ... ({len(listed)} in all)"
    raise ConfigError(
        f"language {name!r}: the model has no code for it; it has {few}: name a language by its code, its ISO 639-1 "
        "or 639-3 name (en, eng, eng_Latn), >>en<< or __en__"
    )


@dataclasses.dataclass(frozen=True)
class Placement:
    """The model's language tokens: `ids[lang]` (a run's languages by file suffix, or a converted model's codes), and
    where `scheme` puts them (one source for batching, decoding and validation). Callers name languages as users do
    (`resolve`)."""

    scheme: str
    ids: dict[str, int]

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> Placement:
        """From a full config: model.language_codes when it has them (every code of the table; data.directions'
        languages must resolve to them), else the languages of data.directions take the last ids of
        model.vocab_size."""
        langs = languages(config.data)
        scheme = config.model.get("lang_token", "none")
        table = tuple(config.model.get("language_codes", ()))
        if scheme not in SCHEMES:
            raise ConfigError(f"model.lang_token: unknown value {scheme!r}; choose one of {list(SCHEMES)}")
        if scheme != "none" and not langs and not table:
            raise ConfigError(f"model.lang_token={scheme!r} needs data.directions (the languages to make tokens for)")
        if not table:
            first = config.model.vocab_size - len(langs)
            return cls(scheme, {lang: first + i for i, lang in enumerate(langs)})
        placement = cls(scheme, {name: int(i) for name, i in table})
        outside = [name for name, i in table if not 0 <= i < config.model.vocab_size]
        if outside or len(set(placement.ids.values())) != len(table):
            raise ConfigError(
                f"model.language_codes: each code needs an id of its own below model.vocab_size="
                f"{config.model.vocab_size}; {outside or 'two codes share one id'}"
            )
        for lang in langs:
            try:
                placement.code_of(lang)
            except ConfigError as e:
                raise ConfigError(f"data.directions: {e}") from None
        return placement

    @property
    def first_id(self) -> int | None:
        return min(self.ids.values()) if self.ids else None

    def code_of(self, lang: str) -> str:
        """The model's code (a key of `ids`) of a language as a user names it (`resolve`)."""
        return resolve(lang, self.ids)

    def has(self, lang: str) -> bool:
        """Whether `lang` names exactly one of the model's languages."""
        try:
            self.code_of(lang)
        except ConfigError:
            return False
        return True

    def id(self, lang: str) -> int:
        """The token id of a language as a user names it (ConfigError for one the model lacks)."""
        return self.ids[self.code_of(lang)]

    def source_prefix(self, d: Direction) -> int | None:
        """The id that starts direction d's sources, or None."""
        if self.scheme == "source":
            return self.id(d.tgt)
        if self.scheme == "source_and_target":
            return self.id(d.src)
        return None

    def target_prefix(self, d: Direction) -> int | None:
        """The id the decoder predicts first (after BOS) for direction d, or None."""
        return self.id(d.tgt) if self.scheme in ("target", "source_and_target") else None


def probabilities(sizes: Sequence[int], temperature: float, weights: Sequence[float] | None = None) -> np.ndarray:
    """Each part's share of the draws: w_i * n_i^(1/T), normalised."""
    if temperature <= 0:
        raise ConfigError(f"data.temperature must be > 0, got {temperature}")
    n = np.asarray(sizes, np.float64)
    w = np.ones_like(n) if weights is None else np.asarray(weights, np.float64)
    scores = w * n ** (1.0 / temperature)
    return scores / scores.sum()


def multiway_sides(directory: str | os.PathLike, split: str, langs: Sequence[str]) -> dict[str, Path]:
    """The files `{split}.{lang}` of a multi-way folder (line i the same sentence in every language), one per
    language, after checking that each exists and that all have one line count (DataError naming two files that
    differ)."""
    directory = sources.resolve_path(directory)
    if not directory.is_dir():
        raise DataError(f"text data directory {directory} does not exist (data.text_dir)")
    paths = {lang: directory / f"{split}.{lang}" for lang in langs}
    for lang, path in paths.items():
        if not path.is_file():
            raise DataError(f"data.directions: no file {path} (split {split!r}, language {lang!r})")
    counts = {lang: sources.count_lines(path) for lang, path in paths.items()}
    first = next(iter(paths))
    for lang, n in counts.items():
        if n != counts[first]:
            raise DataError(
                f"line counts differ: {paths[first]} has {counts[first]} lines, {paths[lang]} has {n}; in a "
                "multi-way folder line i of every file must be the same sentence"
            )
    return paths


def validation_directions(
    config: ml_collections.ConfigDict, split: str | None = None
) -> list[tuple[Direction, list[tuple[str, str]]]]:
    """A multilingual run's validation sets (`config` the full config): each direction of data.directions with the
    pairs of `split` (default data.valid_split), line-aligned lines of {split}.{src} and {split}.{tgt} of the
    multi-way data.text_dir (every language's file checked for one line count), pairs with an empty side left out.
    (eval.extra_valid is refused with directions by the config's checks: its folders are language pairs.)"""
    data = config.data
    if not data.text_dir:
        raise DataError("data.directions needs data.text_dir: a multi-way folder of {split}.{lang} files")
    split = data.valid_split if split is None else split
    paths = multiway_sides(data.text_dir, split, languages(data))
    out = []
    for d in directions(data):
        files = sources.TextPairs(paths[d.src], paths[d.tgt])
        out.append((d, [pair for _, chunk in files.chunks(1 << 16) for pair in chunk]))
    return out
