"""Label names, in process: the dataset's ClassLabel names, unless the config names them.
(What a trained model answers with: tests/e2e/test_model_selection.py.)"""

from conftest import LABEL_NAMES


def test_label_names_from_config_win_over_the_dataset(labeled_reviews):
    import datasets
    from omegaconf import OmegaConf

    from trainer.data import label_names

    ds = datasets.load_dataset(str(labeled_reviews), split="test")
    data_cfg = OmegaConf.create({"label_field": "label", "num_labels": 5, "label_names": None})
    assert label_names(ds, data_cfg) == LABEL_NAMES
    data_cfg.label_names = list("abcde")
    assert label_names(ds, data_cfg) == list("abcde")
