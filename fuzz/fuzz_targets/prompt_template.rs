//! Operator PromptTemplate files: `TemplateStore::from_yaml` (the parser behind
//! `load_dir`) on arbitrary UTF-8; every template that loads is then rendered
//! once with each slot set, so a body that compiles must also render or
//! answer an error.
#![no_main]

use std::collections::HashMap;
use std::path::Path;

use inference_cache_server::prompt_templates::TemplateStore;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let Ok(store) = TemplateStore::from_yaml(text, Path::new("fuzz.yaml")) else {
        return;
    };
    for (name, _) in store.list() {
        let Ok(template) = store.get(name) else {
            continue;
        };
        let variables: HashMap<String, String> = template
            .slots()
            .iter()
            .map(|slot| (slot.name.clone(), "value {{ x }}".to_owned()))
            .collect();
        let _ = template.render(&variables);
    }
});
