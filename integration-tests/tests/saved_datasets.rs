//! Data as verl and TRL users keep it, in every container: the same rows — verl's layout (chat
//! messages in `prompt`, the answer in `reward_model.ground_truth`, `data_source`, `extra_info`)
//! — written as JSONL, as Parquet and by Hugging Face `datasets` with `save_to_disk` (two Arrow
//! shards, or an Arrow IPC file instead of a stream) read to the same prompts, labels and
//! metadata; a `DatasetDict` directory, an empty one and a missing nested key are one-line errors; `rlhf sft` trains from a saved directory. The files are made
//! here with the project's Python (`datasets`, `pyarrow`).

use std::path::Path;
use std::process::Command;

use rlhf_integration_tests::{python, rlhf_bin};
use rlhf_trainer::config::DataConfig;
use rlhf_trainer::data::read_prompt_data;

const MAKE: &str = r#"
import json, sys
import datasets, pyarrow as pa, pyarrow.parquet as pq
out = sys.argv[1]
rows = []
for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 5), (6, 1), (4, 4)]):
    rows.append({
        "data_source": "arith",
        "prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"{a} + {b} ="}],
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": "train", "index": i},
    })
with open(f"{out}/verl.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
pq.write_table(pa.Table.from_pylist(rows), f"{out}/verl.parquet")
ds = datasets.Dataset.from_list(rows)
ds.save_to_disk(f"{out}/saved", num_shards=2)
datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(f"{out}/dict")
bad = [dict(r) for r in rows]
bad[3] = dict(bad[3], reward_model={"style": "rule"})
datasets.Dataset.from_list(bad).save_to_disk(f"{out}/bad")
sft = [{"prompt": f"{a} + {b} =", "response": str(a + b)} for a in range(1, 7) for b in range(1, 7)]
datasets.Dataset.from_list(sft).save_to_disk(f"{out}/sft")
# The same rows in an Arrow IPC file (the random-access format) instead of a stream.
ds.save_to_disk(f"{out}/ipcfile", num_shards=1)
arrow = f"{out}/ipcfile/data-00000-of-00001.arrow"
import os
with pa.ipc.open_stream(arrow) as r:
    table = r.read_all()
# Written beside it, then moved: the table's buffers may map the stream file.
with pa.ipc.new_file(arrow + ".tmp", table.schema) as w:
    w.write_table(table)
os.replace(arrow + ".tmp", arrow)
os.makedirs(f"{out}/emptydict")
with open(f"{out}/emptydict/dataset_dict.json", "w") as f:
    json.dump({"splits": []}, f)
"#;

fn cfg(prompts: &Path) -> DataConfig {
    DataConfig {
        prompts: prompts.to_str().unwrap().to_string(),
        label_key: "reward_model.ground_truth".into(),
        ..DataConfig::default()
    }
}

#[test]
fn jsonl_parquet_and_save_to_disk_read_the_same_rows() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(&python).args(["-c", MAKE, dir.path().to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(dir.path().join("saved/data-00001-of-00002.arrow").is_file(), "two Arrow shards");

    let read = |name: &str| format!("{:?}", read_prompt_data(&cfg(&dir.path().join(name))).unwrap());
    let jsonl = read("verl.jsonl");
    assert!(jsonl.contains("Answer with a number.") && jsonl.contains("\"extra_info\""), "{jsonl}");
    assert_eq!(read("verl.parquet"), jsonl, "Parquet reads other prompts than JSONL");
    assert_eq!(read("saved"), jsonl, "a save_to_disk directory reads other prompts than JSONL");

    let e = read_prompt_data(&cfg(&dir.path().join("dict"))).unwrap_err().to_string();
    assert!(e.contains("a DatasetDict of splits test, train: name one split's directory"), "{e}");
    assert_eq!(read("ipcfile"), jsonl, "an Arrow IPC file reads other prompts than JSONL");
    let e = read_prompt_data(&cfg(&dir.path().join("emptydict"))).unwrap_err().to_string();
    assert!(e.contains("a DatasetDict (dataset_dict.json) with no split directories in it"), "{e}");
    let e = read_prompt_data(&cfg(&dir.path().join("bad"))).unwrap_err().to_string();
    assert!(e.contains("row 4: no `reward_model.ground_truth` (data.label_key)"), "{e}");

    let run = dir.path().join("run");
    let o = Command::new(rlhf_bin())
        .args(["sft", "--no-progress", "--run-dir", run.to_str().unwrap()])
        .args(["--set", &format!("data.train=\"{}\"", dir.path().join("sft").display())])
        .args(["--set", "data.eval_fraction=0.2", "--set", "train.steps=2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("29 train examples") && out.contains("7 eval examples"), "{out}");
}
