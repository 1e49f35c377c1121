"""Only a patch of setuptools' editable install; the project's configuration is pyproject.toml.

setuptools' ``editable_wheel`` installs the data files (the lab extension, under
``share/jupyter/labextensions/``) only where ``distribution.has_data()`` says there are
some, and `Distribution` names that method ``has_data_files``: ``pip install -e .`` would
leave JupyterLab without the extension. tests/integration/test_labextension.py checks the editable
install of the test environment has it.
"""

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel


class EditableWheelWithData(editable_wheel):
    def run(self) -> None:
        if not hasattr(self.distribution, "has_data"):
            self.distribution.has_data = self.distribution.has_data_files
        super().run()


setup(cmdclass={"editable_wheel": EditableWheelWithData})
