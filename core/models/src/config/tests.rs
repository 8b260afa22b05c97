use super::*;

fn write_config(json: &str) -> (tempfile::TempDir, Result<ModelConfig>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), json).unwrap();
    let cfg = ModelConfig::from_dir(dir.path());
    (dir, cfg)
}

const LLAMA: &str = r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,
    "num_attention_heads":2,"num_key_value_heads":1,"intermediate_size":16,"rope_theta":500000.0,
    "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
    "original_max_position_embeddings":16}}"#;

#[test]
fn resolves_llama_with_v4_rope_scaling() {
    let (_d, cfg) = write_config(LLAMA);
    let a = cfg.unwrap().arch;
    assert_eq!((a.head_dim, a.num_kv_heads), (4, 1));
    let rope = a.rope.unwrap();
    assert_eq!(rope.theta, 500000.0);
    assert!(matches!(rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
}

#[test]
fn resolves_v5_rope_parameters() {
    let json = r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,
        "num_attention_heads":2,"intermediate_size":16,
        "rope_parameters":{"rope_type":"linear","factor":2.0,"rope_theta":1000.0}}"#;
    let (_d, cfg) = write_config(json);
    let a = cfg.unwrap().arch;
    assert_eq!(
        a.rope.unwrap(),
        RopeConfig { theta: 1000.0, scaling: RopeScaling::Linear { factor: 2.0 }, mrope: None }
    );
    assert!(a.qkv_bias && !a.o_bias);
}

#[test]
fn errors_name_file_and_key() {
    let (_d, cfg) = write_config(r#"{"model_type":"bert","vocab_size":3}"#);
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("config.json: model_type: unsupported `bert`"), "{e}");

    let (_d, cfg) = write_config(r#"{"model_type":"llama","vocab_size":"many"}"#);
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("config.json: vocab_size: invalid type"), "{e}");

    let (_d, cfg) = write_config("{not json");
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("config.json: invalid JSON"), "{e}");

    let (_d, cfg) = write_config(r#"{"model_type":"llama","vocab_size":3,"hidden_size":8}"#);
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("num_attention_heads: missing"), "{e}");

    let (_d, cfg) = write_config(&LLAMA.replace("llama3", "ntk-by-parts"));
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("rope_scaling.rope_type: unsupported `ntk-by-parts`"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let e = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.ends_with("config.json: not found"), "{e}");

    // A layer count is bounded before per-layer tables are sized by it (it aborted the process
    // with an allocation failure), for the rotary decoders and GPT-2 alike.
    let (_d, cfg) = write_config(&LLAMA.replace(r#""num_hidden_layers":1"#, r#""num_hidden_layers":1000000000000"#));
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("num_hidden_layers: 1000000000000 layers; at most 65536 are supported"), "{e}");
    let gpt2 = r#"{"model_type":"gpt2","vocab_size":10,"n_embd":8,"n_head":2,"n_positions":16,"n_layer":70000}"#;
    let (_d, cfg) = write_config(gpt2);
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("n_layer: 70000 layers; at most 65536"), "{e}");
}

#[test]
fn rope_parameters_must_be_positive() {
    let (_d, cfg) = write_config(&LLAMA.replace(r#""factor":8.0"#, r#""factor":0"#));
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("config.json: rope_scaling.factor: must be a positive number, got 0"), "{e}");
    let (_d, cfg) = write_config(&LLAMA.replace(r#""factor":8.0"#, r#""factor":-2.0"#));
    assert!(cfg.unwrap_err().to_string().contains("rope_scaling.factor"));
    let (_d, cfg) = write_config(&LLAMA.replace(r#""low_freq_factor":1.0"#, r#""low_freq_factor":0.0"#));
    assert!(cfg.unwrap_err().to_string().contains("rope_scaling.low_freq_factor: must be a positive"));
    let json = LLAMA.replace(r#""rope_scaling""#, r#""rope_theta":0,"rope_scaling""#);
    let (_d, cfg) = write_config(&json);
    assert!(cfg.unwrap_err().to_string().contains("config.json: rope_theta: must be a positive number"));
}

/// `rope_scaling` and `rope_parameters` that differ are refused (one would be ignored); the same
/// block under both names (as a converted config holds it) reads once.
#[test]
fn two_rope_blocks_that_differ_are_refused() {
    let both = |params: &str| {
        LLAMA.replace(r#""rope_theta":500000.0,"#, &format!(r#""rope_theta":500000.0,"rope_parameters":{params},"#))
    };
    let (_d, cfg) = write_config(&both(r#"{"rope_type":"linear","factor":2.0}"#));
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("config.json: rope_parameters: both rope_parameters") && e.contains("differ"), "{e}");
    let same = r#"{"type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
        "original_max_position_embeddings":16,"rope_theta":500000.0}"#;
    let (_d, cfg) = write_config(&both(same));
    assert!(matches!(cfg.unwrap().arch.rope.unwrap().scaling, RopeScaling::Llama3 { .. }));
}

/// OLMo 3 with the legacy keys: `rope_scaling` (YaRN) on the full-attention layers only, the
/// sliding ones a plain RoPE of `rope_theta`; by default three layers of every four slide.
#[test]
fn resolves_olmo3_with_legacy_rope_keys() {
    let json = r#"{"model_type":"olmo3","vocab_size":10,"hidden_size":8,"num_hidden_layers":5,
        "num_attention_heads":2,"intermediate_size":16,"rope_theta":10000.0,
        "rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":16}}"#;
    let (_d, cfg) = write_config(json);
    let a = cfg.unwrap().arch;
    assert!(matches!(a.rope.as_ref().unwrap().scaling, RopeScaling::Yarn { .. }));
    assert_eq!(a.rope_local.clone().unwrap(), RopeConfig { theta: 10000.0, scaling: RopeScaling::None, mrope: None });
    assert_eq!(a.sliding_window, Some(4096));
    let sliding: Vec<bool> = (0..5).map(|i| a.is_sliding(i)).collect();
    assert_eq!(sliding, [true, true, true, false, true]);
    assert_eq!((a.qk_norm, a.layout), (QkNorm::Projection, BlockLayout::PostNorm));
}

/// A Qwen3.5 text config as the Hub's checkpoints write it (multimodal RoPE keys, the
/// multi-token-prediction keys, the output gate) resolves with transformers' defaults.
#[test]
fn resolves_qwen3_5_hybrid_layers() {
    let json = r#"{"model_type":"qwen3_5_text","vocab_size":10,"hidden_size":16,"num_hidden_layers":8,
        "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,"intermediate_size":32,
        "attn_output_gate":true,"mtp_num_hidden_layers":1,"mtp_use_dedicated_embeddings":false,
        "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":4,
        "rope_parameters":{"rope_type":"default","rope_theta":10000000,"partial_rotary_factor":0.25,
        "mrope_section":[11,11,10],"mrope_interleaved":true}}"#;
    let (_d, cfg) = write_config(json);
    let a = cfg.unwrap().arch;
    // No `layer_types`: every fourth layer full attention, the others linear.
    let linear: Vec<bool> = (0..8).map(|i| a.is_linear(i)).collect();
    assert_eq!(linear, [true, true, true, false, true, true, true, false]);
    assert_eq!(a.rotary_dim, 4);
    assert_eq!(a.rope.as_ref().unwrap().theta, 1e7);
    assert!(a.attn_output_gate && a.norm == NormKind::Gemma && a.qk_norm == QkNorm::PerHead);
    let l = a.linear_attn.unwrap();
    assert_eq!((l.conv_kernel, l.conv_dim()), (4, 2 * 16 + 16));
    assert!(!a.continues_with_gaps());

    // A key of the checkpoint's vision model, a layer kind, heads that do not divide: refused by name.
    for (edit, key) in [
        (r#""num_hidden_layers":8,"#, r#""num_hidden_layers":8,"vision_config":{},"#),
        (r#""attn_output_gate":true"#, r#""attn_output_gate":false"#),
        (r#""linear_num_key_heads":2"#, r#""linear_num_key_heads":3"#),
        (r#""num_hidden_layers":8,"#, r#""num_hidden_layers":1,"layer_types":["sliding_attention"],"#),
    ] {
        let (_d, cfg) = write_config(&json.replace(edit, key));
        let e = cfg.unwrap_err().to_string();
        let name = ["vision_config", "attn_output_gate", "linear_num_value_heads", "layer_types"]
            .into_iter()
            .find(|n| e.contains(&format!("config.json: {n}")));
        assert!(name.is_some() && e.lines().count() == 1, "{e}");
    }
}

/// The Hub's multimodal Qwen3.5 config: the language model from `text_config` (its keys checked
/// under that name), the vision model's keys allowed at the top level, anything else refused.
#[test]
fn resolves_the_text_model_of_a_multimodal_qwen3_5_and_refuses_what_it_does_not_read() {
    let text = r#"{"model_type":"qwen3_5_text","vocab_size":10,"hidden_size":16,"num_hidden_layers":4,
        "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,"intermediate_size":32,
        "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":4,
        "rope_parameters":{"rope_type":"default","mrope_section":[1,1,0],"partial_rotary_factor":0.25}}"#;
    let json = format!(
        r#"{{"model_type":"qwen3_5","architectures":["Qwen3_5ForConditionalGeneration"],"text_config":{text},
        "vision_config":{{"depth":1,"hidden_size":8,"num_heads":2,"out_hidden_size":16,"num_position_embeddings":4}},
        "image_token_id":5,"tie_word_embeddings":true}}"#
    );
    let (_d, cfg) = write_config(&json);
    let a = cfg.unwrap().arch;
    assert_eq!((a.family, a.backbone_prefix(), a.tie_word_embeddings), (Family::Qwen3_5, "model.language_model", true));
    assert_eq!(a.sequence_classification_architecture(), "Qwen3_5ForSequenceClassification");
    // The vision tower is Qwen3-VL's without a deep stack; the multimodal RoPE interleaves.
    let v = a.vision.clone().unwrap();
    assert_eq!((v.kind, v.patch_size, v.image_token_id, v.deepstack_blocks.len()), (TowerKind::Qwen3, 16, 5, 0));
    assert_eq!(a.rope.as_ref().and_then(|r| r.mrope), Some(Mrope { section: [1, 1, 0], interleaved: true }));
    // Without a section, transformers' default; the sections need not add up when interleaved.
    for (from, want) in [(r#""mrope_section":[1,1,0],"#, [11, 11, 10]), ("[1,1,0]", [1, 1, 1])] {
        let to = if want == [1, 1, 1] { "[1,1,1]" } else { "" };
        let (_d, cfg) = write_config(&json.replace(from, to));
        let rope = cfg.unwrap().arch.rope.unwrap();
        assert_eq!(rope.mrope, Some(Mrope { section: want, interleaved: true }));
    }
    for (edit, name) in [
        (json.replace(r#""image_token_id":5"#, r#""image_token_id":5,"clip_qkv":8"#), "config.json: clip_qkv"),
        (json.replace(r#""hidden_size":16"#, r#""hidden_size":16,"clip_qkv":8"#), "config.json: text_config.clip_qkv"),
        (
            json.replace(r#""model_type":"qwen3_5_text""#, r#""model_type":"qwen3""#),
            "config.json: text_config.model_type",
        ),
        (json.replace(&format!(r#""text_config":{text},"#), ""), "config.json: text_config: missing"),
        (json.replace(r#""depth":1"#, r#""depth":1,"deepstack_visual_indexes":[0]"#), "vision_config.deepstack"),
        (json.replace(r#""num_position_embeddings":4"#, r#""num_position_embeddings":5"#), "not a square grid"),
        // Sizes multiply into shapes: one of 1e12 overflowed the merger's width.
        (
            json.replace(r#""depth":1"#, r#""depth":1,"spatial_merge_size":1000000000000"#),
            "vision_config.spatial_merge_size: expected a positive integer of at most 32768, got 1000000000000",
        ),
    ] {
        let (_d, cfg) = write_config(&edit);
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains(name) && e.lines().count() == 1, "{name}: {e}");
    }
}

const GEMMA4: &str = r#"{"model_type":"gemma4_text","vocab_size":10,"hidden_size":8,"num_hidden_layers":4,
    "num_attention_heads":2,"num_key_value_heads":2,"head_dim":4,"intermediate_size":16,
    "vocab_size_per_layer_input":10,"num_kv_shared_layers":2,"use_double_wide_mlp":true,
    "attention_k_eq_v":true,"num_global_key_value_heads":1,"global_head_dim":8,
    "layer_types":["sliding_attention","full_attention","sliding_attention","sliding_attention"]}"#;

#[test]
fn resolves_gemma4_text_layers_and_refuses_what_it_does_not_implement() {
    let (_d, cfg) = write_config(GEMMA4);
    let a = cfg.unwrap().arch;
    let g = a.gemma4.clone().unwrap();
    // The last layer is forced to full attention, as transformers does.
    assert_eq!(a.layer_types, vec![AttnKind::Sliding, AttnKind::Full, AttnKind::Sliding, AttnKind::Full]);
    assert_eq!(g.heads.iter().map(|h| (h.head_dim, h.kv_heads)).collect::<Vec<_>>(), [(4, 2), (8, 1), (4, 2), (8, 1)]);
    assert_eq!(g.values_are_keys, [false, true, false, true]);
    // Layers 2 and 3 reuse the last earlier layer of their type.
    assert_eq!(g.kv_source, [None, None, Some(0), Some(1)]);
    assert_eq!(g.intermediate, [16, 16, 32, 32]);
    assert_eq!(g.per_layer_input, Some(PerLayerInput { dim: 256, vocab: 10 }));
    assert_eq!((a.rotary_dim, g.local_rotary_dim, a.attn_scale), (8, 4, Some(1.0)));
    let full = a.rope.unwrap().scaling;
    assert!(matches!(full, RopeScaling::Proportional { partial, factor } if partial == 0.25 && factor == 1.0));
    let prepend = |edit: &str| GEMMA4.replacen('{', &format!("{{{edit}"), 1);
    for (json, key) in [
        (prepend(r#""enable_moe_block":true,"num_experts":4,"#), "top_k_experts: missing"),
        (prepend(r#""use_bidirectional_attention":"all","#), "use_bidirectional_attention: \"all\""),
        (prepend(r#""per_layer_config":{"1":{"sliding_window":3}},"#), "per_layer_config.1.sliding_window: not a"),
        (GEMMA4.replace(r#""num_kv_shared_layers":2"#, r#""num_kv_shared_layers":4"#), "num_kv_shared_layers: 4 of 4"),
        (
            GEMMA4.replace(r#""vocab_size_per_layer_input":10"#, r#""vocab_size_per_layer_input":5"#),
            "below vocab_size 10",
        ),
    ] {
        let (_d, cfg) = write_config(&json);
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains(key), "{e}");
    }
    let (_d, cfg) = write_config(&prepend(
        r#""enable_moe_block":true,"num_experts":4,"top_k_experts":2,"moe_intermediate_size":6,"#,
    ));
    let moe = cfg.unwrap().arch.gemma4.unwrap().moe.unwrap();
    assert_eq!((moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob), (4, 2, 6, true));
    // `per_layer_config`, as transformers 5.23 writes it, wins over `global_head_dim`.
    let edit = r#""per_layer_config":{"1":{"head_dim":6,"num_key_value_heads":2},"3":{"head_dim":6}},"#;
    let (_d, cfg) = write_config(&prepend(edit));
    let g = cfg.unwrap().arch.gemma4.unwrap();
    assert_eq!(g.heads.iter().map(|h| (h.head_dim, h.kv_heads)).collect::<Vec<_>>(), [(4, 2), (6, 2), (4, 2), (6, 2)]);
}

/// The Hub's Qwen2.5-VL config: the text model's keys at the top level with the old
/// `rope_scaling: {"type": "mrope"}` and the vision tower's old key spellings; what the tower and
/// the multimodal RoPE need is read, and bad values are refused by name.
#[test]
fn resolves_a_flat_qwen2_5_vl_config_and_refuses_bad_vision_keys() {
    let json = r#"{"model_type":"qwen2_5_vl","architectures":["Qwen2_5_VLForConditionalGeneration"],
        "vocab_size":10,"hidden_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
        "intermediate_size":32,"rope_theta":1000000.0,"use_sliding_window":false,"sliding_window":32768,
        "max_window_layers":70,"rope_scaling":{"type":"mrope","mrope_section":[2,1,1]},
        "image_token_id":7,"video_token_id":8,"vision_start_token_id":5,"vision_end_token_id":6,
        "vision_config":{"depth":2,"hidden_size":8,"intermediate_size":12,"num_heads":2,"in_chans":3,
        "out_hidden_size":16,"spatial_patch_size":14,"window_size":112,"fullatt_block_indexes":[1],
        "tokens_per_second":2,"model_type":"qwen2_5_vl"}}"#;
    let (_d, cfg) = write_config(json);
    let a = cfg.unwrap().arch;
    assert_eq!((a.family, a.backbone_prefix(), a.qkv_bias), (Family::Qwen2, "model.language_model", true));
    let rope = a.rope.unwrap();
    assert_eq!((rope.theta, rope.scaling.clone()), (1e6, RopeScaling::None));
    assert_eq!(rope.mrope, Some(Mrope { section: [2, 1, 1], interleaved: false }));
    let v = a.vision.unwrap();
    assert_eq!(
        (v.depth, v.patch_size, v.in_channels, v.image_token_id, v.fullatt_blocks.clone()),
        (2, 14, 3, 7, vec![1])
    );
    assert_eq!(Mrope { section: [2, 1, 1], interleaved: false }.axes(4), vec![0, 0, 1, 2]);
    assert_eq!(Mrope { section: [2, 1, 1], interleaved: true }.axes(4), vec![0, 1, 2, 0]);
    for (from, to, name) in [
        (r#""mrope_section":[2,1,1]"#, r#""mrope_section":[2,2,1]"#, "rope_scaling.mrope_section"),
        (r#""mrope_section":[2,1,1]"#, r#""mrope_section":[4]"#, "rope_scaling.mrope_section"),
        (r#""out_hidden_size":16"#, r#""out_hidden_size":12"#, "vision_config.out_hidden_size"),
        (
            r#""num_heads":2"#,
            r#""num_heads":2,"deepstack_visual_indexes":[1]"#,
            "vision_config.deepstack_visual_indexes",
        ),
        (r#""num_heads":2"#, r#""num_heads":3"#, "vision_config.num_heads"),
        (r#""window_size":112"#, r#""window_size":14"#, "vision_config.window_size"),
        (r#""hidden_size":16,"#, r#""hidden_size":16,"clip_qkv":8,"#, "clip_qkv"),
    ] {
        let (_d, cfg) = write_config(&json.replace(from, to));
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains(&format!("config.json: {name}")) && e.lines().count() == 1, "{name}: {e}");
    }
}

/// Qwen3-VL: the text model is Qwen3's with Qwen3-VL's `rope_theta` default and the interleaved
/// multimodal RoPE; a deep stack deeper than the language model is refused by name.
#[test]
fn resolves_qwen3_vl_and_refuses_a_deep_stack_deeper_than_the_language_model() {
    let json = r#"{"model_type":"qwen3_vl","text_config":{"model_type":"qwen3_vl_text","vocab_size":10,
        "hidden_size":16,"num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":8,
        "intermediate_size":32,"rope_parameters":{"rope_type":"default","mrope_section":[2,1,1]}},
        "vision_config":{"depth":3,"hidden_size":8,"num_heads":2,"out_hidden_size":16,"num_position_embeddings":4,
        "deepstack_visual_indexes":[0,1]},"image_token_id":5}"#;
    let (_d, cfg) = write_config(json);
    let a = cfg.unwrap().arch;
    let rope = a.rope.clone().unwrap();
    assert_eq!(
        (a.family, rope.theta, rope.mrope),
        (Family::Qwen3, 500_000.0, Some(Mrope { section: [2, 1, 1], interleaved: true }))
    );
    assert_eq!(a.vision.unwrap().deepstack_blocks, vec![0, 1]);
    let (_d, cfg) = write_config(&json.replace("[0,1]", "[0,1,2]"));
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("vision_config.deepstack_visual_indexes: 3 deep-stack features for 2 decoder layers"), "{e}");
    let (_d, cfg) = write_config(&json.replace("[0,1]", "[0,3]"));
    let e = cfg.unwrap_err().to_string();
    assert!(e.contains("vision_config.deepstack_visual_indexes: block 3 of a tower of 3"), "{e}");
}
