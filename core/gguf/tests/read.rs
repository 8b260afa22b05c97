//! Reading hand-built GGUF files: metadata of every type, tensors whose dequantised values are
//! known by hand, and every kind of broken file giving an error that names it.

use std::path::{Path, PathBuf};

use rlhf_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};

/// f16 bit patterns of the scales used below.
const F16_0_125: [u8; 2] = 0x3000u16.to_le_bytes();
const F16_0_25: [u8; 2] = 0x3400u16.to_le_bytes();
const F16_0_5: [u8; 2] = 0x3800u16.to_le_bytes();
const F16_MINUS_1: [u8; 2] = 0xBC00u16.to_le_bytes();
const F16_2: [u8; 2] = 0x4000u16.to_le_bytes();

fn metadata() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(1e-5)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ✓".into())),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f64", Value::F64(-2.5e300)),
        (
            "t.strings",
            Value::Array(ValueType::String, ["<|im_start|>", "Ġt", "", "ü"].map(|s| Value::String(s.into())).to_vec()),
        ),
        ("t.ints", Value::Array(ValueType::I32, vec![Value::I32(3), Value::I32(1), Value::I32(-4)])),
        ("t.empty", Value::Array(ValueType::F32, vec![])),
        (
            "t.nested",
            Value::Array(ValueType::Array, vec![Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)])]),
        ),
    ]
}

/// Two Q4_1 blocks (one row of 64): block 0 has d = 0.5, m = -1 and byte j = (15 - j) << 4 | j;
/// block 1 has d = 0.25, m = 2 and every byte 0x3A (low nibble 10, high nibble 3).
fn q4_1_data() -> Vec<u8> {
    let mut data = Vec::new();
    data.extend(F16_0_5);
    data.extend(F16_MINUS_1);
    data.extend((0u8..16).map(|j| ((15 - j) << 4) | j));
    data.extend(F16_0_25);
    data.extend(F16_2);
    data.extend([0x3Au8; 16]);
    data
}

/// Element j of block 0 is 0.5·j − 1 for j < 16 and 0.5·(15 − (j − 16)) − 1 after; block 1 is
/// 0.25·10 + 2 = 4.5 for its first 16 elements and 0.25·3 + 2 = 2.75 for the rest.
fn q4_1_expected() -> Vec<f32> {
    let mut v: Vec<f32> = (0..16).map(|j| 0.5 * j as f32 - 1.0).collect();
    v.extend((0..16).map(|j| 0.5 * (15 - j) as f32 - 1.0));
    v.extend([4.5; 16]);
    v.extend([2.75; 16]);
    v
}

/// One Q8_0 block: d = 0.125, q_j = j − 16.
fn q8_0_data() -> Vec<u8> {
    let mut data = F16_0_125.to_vec();
    data.extend((0..32).map(|j| (j as i8 - 16) as u8));
    data
}

/// One Q4_0 block: d = 2, byte j = j << 4 | (15 - j); element j = 2·(15 − j − 8), 16 + j = 2·(j − 8).
fn q4_0_data() -> Vec<u8> {
    let mut data = F16_2.to_vec();
    data.extend((0u8..16).map(|j| (j << 4) | (15 - j)));
    data
}

fn sample_file(alignment: Option<u32>) -> GgufWriter {
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w = w.kv("general.alignment", Value::U32(a));
    }
    for (k, v) in metadata() {
        w = w.kv(k, v);
    }
    w.tensor_f32("plain", &[3, 2], &[1.0, 2.0, 3.0, -4.0, 0.5, 1e-3])
        .tensor("q41", &[64, 1], GgmlType::Q4_1, q4_1_data())
        .tensor("q80", &[32], GgmlType::Q8_0, q8_0_data())
        .tensor("q40", &[32], GgmlType::Q4_0, q4_0_data())
        .tensor("half", &[2], GgmlType::F16, [0x3E00u16, 0xC000].iter().flat_map(|v| v.to_le_bytes()).collect())
        .tensor("brain", &[2], GgmlType::BF16, [0x3F80u16, 0xBF00].iter().flat_map(|v| v.to_le_bytes()).collect())
}

fn temp_file(name: &str, bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    (dir, path)
}

fn open(bytes: &[u8]) -> (Result<GgufFile, GgufError>, PathBuf) {
    let (dir, path) = temp_file("model.gguf", bytes);
    let result = GgufFile::open(&path);
    drop(dir);
    (result, path)
}

fn assert_names(err: &GgufError, path: &Path) {
    assert!(err.to_string().contains(&path.display().to_string()), "{err} should name {}", path.display());
}

#[test]
fn metadata_round_trips_in_order() {
    let (dir, path) = temp_file("m.gguf", &sample_file(None).to_bytes());
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 3);
    let want: Vec<(String, Value)> = metadata().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    assert_eq!(g.metadata, want);
    assert_eq!(g.get("t.f32").unwrap().as_f64(), Some(1e-5), "f32 widens through its shortest decimal");
    assert_eq!(g.opt_str_array("t.strings").unwrap().unwrap(), vec!["<|im_start|>", "Ġt", "", "ü"]);
    assert_eq!(g.opt_int_array("t.ints").unwrap().unwrap(), vec![3, 1, -4]);
    assert_eq!(g.req_u64("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(g.opt_u64("t.absent").unwrap(), None);
    let err = g.req_u64("t.string").unwrap_err();
    assert!(err.to_string().contains("t.string") && err.to_string().contains("integer"), "{err}");
    assert_names(&err, &path);
    assert_eq!(g.alignment, 32);
    assert_eq!(g.data_offset % 32, 0);
    drop(dir);
}

#[test]
fn tensors_dequantise_to_hand_computed_values() {
    for alignment in [None, Some(64), Some(1)] {
        let g = GgufFile::from_bytes(Path::new("mem.gguf"), sample_file(alignment).to_bytes()).unwrap();
        assert_eq!(g.alignment, alignment.map_or(32, u64::from));
        let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["plain", "q41", "q80", "q40", "half", "brain"]);

        let plain = g.tensor("plain").unwrap();
        assert_eq!(plain.shape(), [2, 3], "dims are innermost first");
        assert_eq!(plain.ggml_type, GgmlType::F32);
        assert_eq!(g.dequantize(plain).unwrap(), [1.0, 2.0, 3.0, -4.0, 0.5, 1e-3]);

        let q41 = g.tensor("q41").unwrap();
        assert_eq!((q41.shape(), q41.n_bytes()), (vec![1, 64], 40));
        let got = g.dequantize(q41).unwrap();
        assert_eq!(got, q4_1_expected());
        // Spot checks written out: low nibbles first, then high nibbles.
        assert_eq!(&got[..3], [-1.0, -0.5, 0.0]);
        assert_eq!(got[15], 6.5);
        assert_eq!(got[16], 6.5);
        assert_eq!(got[31], -1.0);
        assert_eq!((got[32], got[48]), (4.5, 2.75));

        let q80 = g.dequantize(g.tensor("q80").unwrap()).unwrap();
        assert_eq!(q80, (0..32).map(|j| (j - 16) as f32 * 0.125).collect::<Vec<_>>());
        assert_eq!((q80[0], q80[16], q80[31]), (-2.0, 0.0, 1.875));

        let q40 = g.dequantize(g.tensor("q40").unwrap()).unwrap();
        assert_eq!((q40[0], q40[15], q40[16], q40[31]), (14.0, -16.0, -16.0, 14.0));
        let mut want: Vec<f32> = (0..16).map(|j| 2.0 * (7 - j) as f32).collect();
        want.extend((0..16).map(|j| 2.0 * (j - 8) as f32));
        assert_eq!(q40, want);

        assert_eq!(g.dequantize(g.tensor("half").unwrap()).unwrap(), [1.5, -2.0]);
        assert_eq!(g.dequantize(g.tensor("brain").unwrap()).unwrap(), [1.0, -0.5]);
    }
}

#[test]
fn version_2_reads_too() {
    let g = GgufFile::from_bytes(Path::new("v2.gguf"), sample_file(None).version(2).to_bytes()).unwrap();
    assert_eq!(g.version, 2);
    assert_eq!(g.tensors.len(), 6);
}

#[test]
fn truncated_files_are_errors_naming_the_file() {
    let bytes = sample_file(None).to_bytes();
    let g = GgufFile::from_bytes(Path::new("x"), bytes.clone()).unwrap();
    let header_end = 24;
    let data_start = g.data_offset as usize;
    // Empty, inside the magic, the header, the metadata, the tensor infos, the data, the last byte.
    for cut in [0, 2, 10, header_end + 5, data_start - 40, data_start + 10, bytes.len() - 1] {
        let (result, path) = open(&bytes[..cut]);
        let err = result.expect_err(&format!("cut at {cut} must fail"));
        assert!(matches!(err, GgufError::Truncated { .. }), "cut at {cut}: {err}");
        assert!(err.to_string().contains("truncated"), "{err}");
        assert_names(&err, &path);
    }
}

#[test]
fn wrong_magic() {
    let mut bytes = sample_file(None).to_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let (result, path) = open(&bytes);
    let err = result.unwrap_err();
    assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
    assert!(err.to_string().contains("not a GGUF file"), "{err}");
    assert_names(&err, &path);

    let (result, path) = open(b"{\"not\": \"gguf\"}");
    let err = result.unwrap_err();
    assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
    assert_names(&err, &path);
}

#[test]
fn unsupported_versions() {
    for version in [1, 4, 0] {
        let (result, path) = open(&sample_file(None).version(version).to_bytes());
        let err = result.unwrap_err();
        assert!(matches!(err, GgufError::UnsupportedVersion { version: v, .. } if v == version), "{err}");
        assert!(err.to_string().contains(&format!("version {version}")), "{err}");
        assert_names(&err, &path);
    }
    // A big-endian file: the version reads byte-swapped.
    let (result, path) = open(&sample_file(None).version(3u32.swap_bytes()).to_bytes());
    let err = result.unwrap_err();
    assert!(err.to_string().contains("big-endian"), "{err}");
    assert_names(&err, &path);
}

#[test]
fn unknown_tensor_type() {
    let bytes = GgufWriter::new().tensor_with_type_id("mystery.weight", &[32], 99, vec![0; 64]).to_bytes();
    let (result, path) = open(&bytes);
    let err = result.unwrap_err();
    assert!(matches!(err, GgufError::UnknownTensorType { type_id: 99, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("mystery.weight") && msg.contains("99") && msg.contains("Q4_1"), "{msg}");
    assert_names(&err, &path);
}

#[test]
fn known_type_without_dequantiser_is_refused_when_read() {
    // Q2_K: 256 elements in 84 bytes. The file parses; dequantising names the type.
    let bytes = GgufWriter::new().tensor("k.weight", &[256], GgmlType::Q2_K, vec![0; 84]).to_bytes();
    let (dir, path) = temp_file("k.gguf", &bytes);
    let g = GgufFile::open(&path).unwrap();
    let err = g.dequantize(g.tensor("k.weight").unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("Q2_K") && msg.contains("k.weight") && msg.contains("Q6_K"), "{msg}");
    assert_names(&err, &path);
    drop(dir);
}

#[test]
fn malformed_contents() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (GgufWriter::new().kv("a", Value::U8(1)).kv("a", Value::U8(2)).to_bytes(), "appears twice"),
        (GgufWriter::new().tensor_f32("t", &[1], &[1.0]).tensor_f32("t", &[1], &[2.0]).to_bytes(), "appears twice"),
        (GgufWriter::new().kv("general.alignment", Value::U32(24)).to_bytes(), "power of two"),
        (GgufWriter::new().tensor("q", &[16], GgmlType::Q4_1, vec![0; 20]).to_bytes(), "block size"),
        (GgufWriter::new().tensor_f32("t", &[1, 1, 1, 1, 1], &[1.0]).to_bytes(), "dimensions"),
    ];
    for (bytes, needle) in cases {
        let (result, path) = open(&bytes);
        let err = result.unwrap_err();
        assert!(err.to_string().contains(needle), "{err} should mention {needle:?}");
        assert_names(&err, &path);
    }
    // A bool that is neither 0 nor 1.
    let mut bytes = GgufWriter::new().kv("b", Value::Bool(true)).to_bytes();
    // Header (24 bytes), key (8 + 1), value type (4), then the bool.
    let pos = 24 + 9 + 4;
    assert_eq!(bytes[pos], 1);
    bytes[pos] = 7;
    let (result, _) = open(&bytes);
    assert!(result.unwrap_err().to_string().contains("bool"));
}

#[test]
fn huge_declared_lengths_fail_without_allocating() {
    // A string claiming u64::MAX / 2 bytes, an array claiming 2^40 elements, 2^50 tensors.
    let mut s = b"GGUF".to_vec();
    s.extend(3u32.to_le_bytes());
    s.extend(0u64.to_le_bytes());
    s.extend(1u64.to_le_bytes());
    s.extend((u64::MAX / 2).to_le_bytes());
    let mut a = b"GGUF".to_vec();
    a.extend(3u32.to_le_bytes());
    a.extend(0u64.to_le_bytes());
    a.extend(1u64.to_le_bytes());
    a.extend(1u64.to_le_bytes());
    a.push(b'k');
    a.extend(9u32.to_le_bytes());
    a.extend(4u32.to_le_bytes());
    a.extend((1u64 << 40).to_le_bytes());
    let mut t = b"GGUF".to_vec();
    t.extend(3u32.to_le_bytes());
    t.extend((1u64 << 50).to_le_bytes());
    t.extend(0u64.to_le_bytes());
    for bytes in [s, a, t] {
        let (result, path) = open(&bytes);
        let err = result.unwrap_err();
        assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
        assert_names(&err, &path);
    }
}

#[test]
fn missing_file_names_it() {
    let err = GgufFile::open(Path::new("/nonexistent/dir/model.gguf")).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/dir/model.gguf"), "{err}");
    // A directory is named as one (mapping it would say "No such device").
    let dir = tempfile::tempdir().unwrap();
    let err = GgufFile::open(dir.path()).unwrap_err().to_string();
    assert_eq!(err, format!("{}: is a directory, not a GGUF file", dir.path().display()));
}

/// Two tensors whose data ranges overlap (the second's offset moved into the first's data) are
/// refused, naming both: one would otherwise import the other's bytes.
#[test]
fn overlapping_tensors_are_refused() {
    let mut bytes = GgufWriter::new().tensor_f32("a", &[16], &[1.0; 16]).tensor_f32("b", &[16], &[2.0; 16]).to_bytes();
    // `b`'s info: u64 name length 1, "b", u32 n_dims, u64 dim, u32 type, then its u64 offset.
    let name = [1u64.to_le_bytes().as_slice(), b"b"].concat();
    let at = bytes.windows(name.len()).position(|w| w == name.as_slice()).unwrap() + name.len() + 4 + 8 + 4;
    assert_eq!(u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()), 64);
    bytes[at..at + 8].copy_from_slice(&32u64.to_le_bytes());
    let (result, path) = open(&bytes);
    let err = result.unwrap_err();
    assert!(
        err.to_string().contains("tensors `a` (bytes 0..64 of the data section) and `b` (from byte 32) overlap"),
        "{err}"
    );
    assert_names(&err, &path);
}
