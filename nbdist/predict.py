"""The old name of nbdist/verdicts.py (the labs' verdicts on a learner's predictions): `nbdist.predict.compare`
still works, once saying its new name. Import `nbdist.verdicts` instead; this module will go."""
import warnings

from nbdist.verdicts import Verdict, compare  # noqa: F401 - the old names, for notebooks written before

warnings.warn("nbdist.predict is now nbdist.verdicts (the labs' verdicts on a prediction): import "
              "`from nbdist.verdicts import compare`; nbdist.predict will go", FutureWarning, stacklevel=2)
