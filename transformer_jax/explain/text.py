"""The page's words in English and Hindi (the language of the article the project grew from).

Only headings, one-line explanations and labels are translated; numbers, formulas and token pieces are the same
in both. Every language has exactly the same keys (the tests check), so a missing string fails at once.
"""

from __future__ import annotations

LANGUAGES = ("en", "hi")

TEXT: dict[str, dict[str, str]] = {
    "en": {
        "title": "The mathematics of “Attention Is All You Need”, run on one sentence",
        "intro": "Every number below was computed by the model's own modules (the code that training and "
        "evaluate.py run) on this sentence; the checks compare them with the equations.",
        "sentence": "Sentence",
        "translation": "Translation (as evaluate.py gives it)",
        "model": "Model",
        "checkpoint": "Checkpoint steps averaged",
        "decoding": "Decoding",
        "shown": "Shown in detail: layer {layer}, head {head}",
        "target_own": "The decoder is fed the model's own translation (teacher forcing).",
        "target_given": "The decoder is fed the target given with --target (teacher forcing).",
        "truncated": "The sentence has {before} tokens with </s>, more than the model's limit of {after}: it was cut "
        "to {after} tokens, as evaluate.py cuts it.",
        "h_tokens": "1. Tokens",
        "p_tokens": "SentencePiece splits the sentence into pieces (▁ starts a word); </s> ends the source.",
        "h_embed": "2. Embeddings × √d_model",
        "p_embed": "Each piece looks up its row of the embedding matrix E; the row is multiplied by √d_model so "
        "that it is on the scale of the positional encoding.",
        "h_pe": "3. + Positional encoding",
        "p_pe": "PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) is added, so the "
        "model knows the order. Shifting by k positions is a rotation: PE(pos+k) = M_k · PE(pos).",
        "pe_check": "Checked on this sentence's positions: {pairs} pairs (pos, pos+k), largest |PE(pos+k) − "
        "M_k·PE(pos)| = {error}.",
        "pe_learned": "This model learns its position table (no sinusoid), so PE(pos+k) = M_k·PE(pos) does not hold.",
        "h_qkv": "4. Q, K and V of one head",
        "p_qkv": "Q = X W^Q, K = X W^K, V = X W^V, split into heads; encoder layer {layer}, head {head}.",
        "h_scores": "5. QKᵀ, then divided by √d_k",
        "p_scores": "If the d_k components of q and k have variance 1, q·k has variance d_k; dividing by √d_k brings "
        "it back to about 1, so the softmax is not saturated.",
        "variance": "Measured: var(q) = {var_q}, var(k) = {var_k}, d_k = {d_k}; var(QKᵀ) = {var_scores}; "
        "var(QKᵀ/√d_k) = {var_scaled}.",
        "h_softmax": "6. Softmax: the attention weights",
        "p_softmax": "weights = softmax(QKᵀ/√d_k), each row sums to 1. The softmax of the scores above equals the "
        "model's own weights to {error}.",
        "h_heads": "7. weights · V, the heads concatenated, × W^O",
        "p_heads": "head_i = weights · V; the model's head output equals weights·V to {error}. The {heads} heads "
        "are concatenated ([T, {concat}]) and projected by W^O back to d_model = {d_model}.",
        "h_norm": "8. Residual + LayerNorm",
        "p_norm": "LayerNorm(x + Sublayer(x)) normalises each position's features to mean 0 and variance 1 "
        "(then scales and shifts them).",
        "p_norm_pre": "This model is pre-LN: x + Sublayer(LayerNorm(x)); the norm brings each position's features "
        "to mean 0 and variance 1 before each sublayer.",
        "norm_row": "mean {mean_in} → {mean_out}; variance {var_in} → {var_out}",
        "h_ffn": "9. Feed-forward network",
        "p_ffn": "FFN(x) = max(0, x W1 + b1) W2 + b2, at each position.",
        "ffn_zero": "Fraction of ReLU outputs that are exactly 0: {fraction} (encoder layer {layer}), "
        "{fraction_dec} (decoder layer {layer}).",
        "ffn_other": "This model's FFN uses {activation}, not ReLU: no outputs are clamped to 0.",
        "h_causal": "10. The decoder's causal mask",
        "p_causal": "Position i sees position j only if j ≤ i: the decoder cannot read the future. The model's "
        "weights above the diagonal are at most {above}.",
        "h_cross": "11. Cross-attention: target pieces attend to source pieces",
        "p_cross": "Q from the decoder, K and V from the encoder's output; decoder layer {layer}, head {head}.",
        "h_logits": "12. Logits and the next-token probabilities",
        "p_logits": "logits = y Eᵀ, P(next) = softmax(logits). At each step: the piece fed, the piece that follows, "
        "and the five most probable pieces.",
        "h_beam": "13. Beam search, step by step",
        "p_beam": "Beam size {beam}, length penalty α = {alpha}: score = log P / ((5 + |Y|)/6)^α. The live "
        "hypotheses after each step, best first.",
        "step": "step",
        "fed": "fed",
        "next": "next",
        "p_next": "P(next)",
        "top": "top 5 (probability)",
        "hypothesis": "hypothesis",
        "score": "score",
        "log_prob": "log P",
        "ended": "ended with </s>",
        "position": "position",
        "piece": "piece",
        "id": "id",
        "features": "features",
        "alt_embed": "heatmap of the scaled embedding rows, one row per source piece",
        "alt_pe": "heatmap of the positional encoding added at each source position",
        "alt_scores": "heatmaps of QKᵀ before and after dividing by √d_k",
        "alt_softmax": "heatmap of the attention weights of one encoder head",
        "alt_causal": "the causal mask and the decoder self-attention weights of one head",
        "alt_cross": "heatmap of cross-attention weights between target and source pieces",
    },
    "hi": {
        "title": "“Attention Is All You Need” का गणित, एक वाक्य पर चलाकर",
        "intro": "नीचे की हर संख्या मॉडल के अपने मॉड्यूलों (वही कोड जो प्रशिक्षण और evaluate.py चलाते हैं) ने इसी "
        "वाक्य पर गणना की है; जाँचें उन्हें समीकरणों से मिलाती हैं।",
        "sentence": "वाक्य",
        "translation": "अनुवाद (जैसा evaluate.py देता है)",
        "model": "मॉडल",
        "checkpoint": "औसत किए गए चेकपॉइंट चरण",
        "decoding": "डिकोडिंग",
        "shown": "विस्तार से: परत {layer}, हेड {head}",
        "target_own": "डिकोडर को मॉडल का अपना अनुवाद दिया गया है (टीचर फ़ोर्सिंग)।",
        "target_given": "डिकोडर को --target से दिया गया लक्ष्य वाक्य दिया गया है (टीचर फ़ोर्सिंग)।",
        "truncated": "वाक्य में </s> सहित {before} टोकन हैं, मॉडल की सीमा {after} से अधिक: इसे {after} टोकन तक "
        "काटा गया, जैसे evaluate.py काटता है।",
        "h_tokens": "1. टोकन",
        "p_tokens": "SentencePiece वाक्य को टुकड़ों में बाँटता है (▁ शब्द की शुरुआत है); </s> स्रोत का अंत है।",
        "h_embed": "2. एम्बेडिंग × √d_model",
        "p_embed": "हर टुकड़ा एम्बेडिंग मैट्रिक्स E की अपनी पंक्ति लेता है; पंक्ति को √d_model से गुणा किया जाता है "
        "ताकि वह स्थितीय एन्कोडिंग के पैमाने पर हो।",
        "h_pe": "3. + स्थितीय एन्कोडिंग",
        "p_pe": "PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) जोड़ा जाता है, "
        "ताकि मॉडल क्रम जाने। k स्थान खिसकाना एक घूर्णन है: PE(pos+k) = M_k · PE(pos)।",
        "pe_check": "इस वाक्य की स्थितियों पर जाँचा गया: {pairs} जोड़े (pos, pos+k), सबसे बड़ा |PE(pos+k) − "
        "M_k·PE(pos)| = {error}।",
        "pe_learned": "यह मॉडल अपनी स्थिति तालिका सीखता है (साइनसॉइड नहीं), इसलिए PE(pos+k) = M_k·PE(pos) लागू नहीं होता।",
        "h_qkv": "4. एक हेड के Q, K और V",
        "p_qkv": "Q = X W^Q, K = X W^K, V = X W^V, हेडों में बाँटे गए; एन्कोडर परत {layer}, हेड {head}।",
        "h_scores": "5. QKᵀ, फिर √d_k से भाग",
        "p_scores": "यदि q और k के d_k घटकों का प्रसरण 1 हो, तो q·k का प्रसरण d_k होता है; √d_k से भाग देने पर "
        "यह लगभग 1 हो जाता है, ताकि सॉफ्टमैक्स संतृप्त न हो।",
        "variance": "मापा गया: var(q) = {var_q}, var(k) = {var_k}, d_k = {d_k}; var(QKᵀ) = {var_scores}; "
        "var(QKᵀ/√d_k) = {var_scaled}।",
        "h_softmax": "6. सॉफ्टमैक्स: ध्यान भार",
        "p_softmax": "भार = softmax(QKᵀ/√d_k), हर पंक्ति का योग 1 है। ऊपर के स्कोर का सॉफ्टमैक्स मॉडल के अपने भारों "
        "के बराबर है, अंतर {error}।",
        "h_heads": "7. भार · V, हेडों को जोड़ना, × W^O",
        "p_heads": "head_i = भार · V; मॉडल का हेड आउटपुट भार·V के बराबर है, अंतर {error}। {heads} हेड जोड़े जाते हैं "
        "([T, {concat}]) और W^O से वापस d_model = {d_model} पर प्रक्षेपित होते हैं।",
        "h_norm": "8. अवशिष्ट संबंध + परत सामान्यीकरण (LayerNorm)",
        "p_norm": "LayerNorm(x + Sublayer(x)) हर स्थिति की विशेषताओं को माध्य 0 और प्रसरण 1 पर लाता है (फिर उन्हें "
        "मापता और खिसकाता है)।",
        "p_norm_pre": "यह मॉडल pre-LN है: x + Sublayer(LayerNorm(x)); हर उप-परत से पहले सामान्यीकरण हर स्थिति की "
        "विशेषताओं को माध्य 0 और प्रसरण 1 पर लाता है।",
        "norm_row": "माध्य {mean_in} → {mean_out}; प्रसरण {var_in} → {var_out}",
        "h_ffn": "9. फ़ीड-फ़ॉरवर्ड नेटवर्क",
        "p_ffn": "FFN(x) = max(0, x W1 + b1) W2 + b2, हर स्थिति पर।",
        "ffn_zero": "ReLU के ठीक 0 वाले आउटपुट का अंश: {fraction} (एन्कोडर परत {layer}), {fraction_dec} "
        "(डिकोडर परत {layer})।",
        "ffn_other": "इस मॉडल का FFN ReLU नहीं, {activation} उपयोग करता है: कोई आउटपुट 0 पर नहीं काटा जाता।",
        "h_causal": "10. डिकोडर का कारणात्मक मास्क",
        "p_causal": "स्थिति i, स्थिति j को तभी देखती है जब j ≤ i: डिकोडर भविष्य नहीं पढ़ सकता। विकर्ण के ऊपर मॉडल "
        "के भार अधिकतम {above} हैं।",
        "h_cross": "11. क्रॉस-अटेंशन: लक्ष्य के टुकड़े स्रोत के टुकड़ों पर ध्यान देते हैं",
        "p_cross": "Q डिकोडर से, K और V एन्कोडर के आउटपुट से; डिकोडर परत {layer}, हेड {head}।",
        "h_logits": "12. लॉजिट और अगले टोकन की प्रायिकताएँ",
        "p_logits": "logits = y Eᵀ, P(अगला) = softmax(logits)। हर चरण पर: दिया गया टुकड़ा, अगला टुकड़ा, और पाँच सबसे "
        "संभावित टुकड़े।",
        "h_beam": "13. बीम सर्च, चरण दर चरण",
        "p_beam": "बीम आकार {beam}, लंबाई दंड α = {alpha}: स्कोर = log P / ((5 + |Y|)/6)^α। हर चरण के बाद जीवित "
        "परिकल्पनाएँ, सबसे अच्छी पहले।",
        "step": "चरण",
        "fed": "दिया गया",
        "next": "अगला",
        "p_next": "P(अगला)",
        "top": "शीर्ष 5 (प्रायिकता)",
        "hypothesis": "परिकल्पना",
        "score": "स्कोर",
        "log_prob": "log P",
        "ended": "</s> पर समाप्त",
        "position": "स्थिति",
        "piece": "टुकड़ा",
        "id": "आईडी",
        "features": "विशेषताएँ",
        "alt_embed": "स्केल की गई एम्बेडिंग पंक्तियों का हीटमैप, हर स्रोत टुकड़े की एक पंक्ति",
        "alt_pe": "हर स्रोत स्थिति पर जोड़ी गई स्थितीय एन्कोडिंग का हीटमैप",
        "alt_scores": "√d_k से भाग देने से पहले और बाद QKᵀ के हीटमैप",
        "alt_softmax": "एक एन्कोडर हेड के ध्यान भारों का हीटमैप",
        "alt_causal": "कारणात्मक मास्क और एक हेड के डिकोडर सेल्फ-अटेंशन भार",
        "alt_cross": "लक्ष्य और स्रोत टुकड़ों के बीच क्रॉस-अटेंशन भारों का हीटमैप",
    },
}
